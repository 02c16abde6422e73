#!/usr/bin/env bash
# CI's style checks (issue 37): every tracked C++ file is as clang-format (the repo's
# .clang-format) writes it, and no file in src/ or tools/ is over 700 lines nor any function body
# over 100 (scripts/check_sizes.py). Prints each offender; exits 1 when there is one.
# `make format` rewrites the files in place.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format > /dev/null || { echo "check_format: clang-format is not installed (scripts/install-deps.sh installs it)"; exit 1; }
mapfile -t files < <(git ls-files -- 'include/*.h' 'src/*.h' 'src/*.cpp' 'tests/*.h' 'tests/*.cpp' \
                                     'tools/*.h' 'tools/*.cpp' 'bench/*.h' 'bench/*.cpp' 'examples/*.cpp' \
                                     'python/*.h' 'python/*.cpp')
status=0
clang-format --dry-run --Werror "${files[@]}" || status=1
/usr/bin/python3 scripts/check_sizes.py src tools || status=1
if [[ $status != 0 ]]; then
  echo "check_format: fix the above (make format for the layout)"
else
  echo "check_format: ${#files[@]} files formatted; sizes within limits"
fi
exit $status
