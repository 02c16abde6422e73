#!/usr/bin/env python3
"""Writes tests/cases.txt: the label of every gtest case, from running it.

Runs each gtest program of a build tree (the programs registered with torchpar_add_test,
found through `ctest --show-only=json-v1`) one at a time, whole, with TORCHPAR_TEST_CENSUS set
(tests/support/run_tests.cpp): each case reports its wall time and how many processes it, its
suite's set-up or the processes they started started (fork() calls). A case is
    fast       when it started no process and took under a second,
    single     when it started no process and took longer,
    multiproc  when it started one.
tests/CMakeLists.txt reads the file at configure time: fast cases of a program share one ctest
(`<program>:fast`), every other case is a ctest of its own (`<program>:<Suite.Case>`) with its
census time as COST.

Run it after adding or changing test cases, on an otherwise idle machine (times decide `fast`):
    scripts/test_census.py [--build build] [--program NAME ...]
With --program, only those programs are run again and the others' lines are kept.
    scripts/test_census.py --check
lists the cases the programs have that the file does not (they run as `<program>:new`,
labelled multiproc), and exits 1 when there are any.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "cases.txt"
HEADER = """\
# The gtest cases and their labels, written by scripts/test_census.py (do not edit by hand):
#   <program> <Suite.Case> fast|single|multiproc <seconds, when the census ran it alone>
# fast: no process started, under a second; single: no process started; multiproc: started one.
"""
FAST_SECONDS = 1.0


def programs(build: Path) -> list[Path]:
    """The gtest programs the build tree's ctest runs: commands under tests/ named *_test."""
    out = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, check=True,
                         capture_output=True, text=True).stdout
    found = {}
    for test in json.loads(out)["tests"]:
        command = test.get("command") or []
        if command and Path(command[0]).parent == (build / "tests").resolve() \
                and Path(command[0]).name.endswith("_test"):
            found[Path(command[0]).name] = Path(command[0])
    return [found[name] for name in sorted(found)]


def listed(program: Path) -> list[str]:
    """The cases `--gtest_list_tests` names, DISABLED_ ones left out."""
    out = subprocess.run([str(program), "--gtest_list_tests"], check=True, capture_output=True,
                         text=True).stdout
    cases, suite = [], ""
    for line in out.splitlines():
        if not line.strip():
            continue
        name = line.split("#")[0].strip()
        if not line.startswith(" "):
            suite = name
        elif "DISABLED_" not in suite + name:
            cases.append(suite + name)
    return cases


def read_cases() -> dict[tuple[str, str], str]:
    lines = {}
    if CASES.exists():
        for line in CASES.read_text().splitlines():
            if line and not line.startswith("#"):
                program, case, _, _ = line.split(" ")
                lines[(program, case)] = line
    return lines


def census(program: Path) -> list[str]:
    """Runs `program` whole; one line per case it ran."""
    with tempfile.NamedTemporaryFile("r", suffix=".census") as record:
        env = dict(os.environ, TORCHPAR_TEST_CENSUS=record.name)
        print(f"census: {program.name} ...", file=sys.stderr, flush=True)
        try:
            run = subprocess.run([str(program)], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        finally:
            Path(record.name + ".forks").unlink(missing_ok=True)
        if run.returncode != 0:
            sys.stderr.write(run.stderr[-4000:])
            raise SystemExit(f"census: {program.name} failed (exit {run.returncode}); "
                             "a census is taken of a passing suite")
        lines = []
        for line in record.read().splitlines():
            name, case, ms, forks = line.split(" ")
            seconds = int(ms) / 1000.0
            label = "multiproc" if int(forks) > 0 else (
                "fast" if seconds < FAST_SECONDS else "single")
            lines.append(f"{name} {case} {label} {seconds:.1f}")
        return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=str(ROOT / "build"), type=Path)
    parser.add_argument("--program", action="append", default=[])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    build = args.build.resolve()
    progs = programs(build)
    if args.check:
        known = read_cases()
        missing = [f"{p.name} {case}" for p in progs for case in listed(p)
                   if (p.name, case) not in known]
        for line in missing:
            print(f"not in tests/cases.txt: {line}")
        return 1 if missing else 0
    unknown = set(args.program) - {p.name for p in progs}
    if unknown:
        raise SystemExit(f"census: no such test program: {', '.join(sorted(unknown))}")
    kept = [line for (program, _), line in read_cases().items()
            if args.program and program not in args.program]
    fresh = [line for p in progs if not args.program or p.name in args.program
             for line in census(p)]
    CASES.write_text(HEADER + "\n".join(sorted(kept + fresh)) + "\n")
    counts = {}
    for line in kept + fresh:
        label = line.split(" ")[2]
        counts[label] = counts.get(label, 0) + 1
    print(f"census: {CASES.relative_to(ROOT)}: "
          + ", ".join(f"{n} {label}" for label, n in sorted(counts.items())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
