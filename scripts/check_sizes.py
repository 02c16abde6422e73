#!/usr/bin/python3
"""Size check of issue 37: no source file over 700 lines, no function body over 100 lines.

Usage: scripts/check_sizes.py [--max-file N] [--max-function N] [dirs...]   (default: src tools)
Prints each offender as path:line: what, and exits 1 when there is one. A "function" is a brace
block at namespace or class scope opened after a parameter list ')' (with any trailing
const/noexcept/override/-> type/initialiser list); lambdas count toward the function holding them.
A heuristic, not a C++ parser: comments, strings and character literals are stripped first.
"""
import argparse
import os
import re
import sys

STRIP = re.compile(
    r'//[^\n]*|/\*.*?\*/|R"([^(]*)\(.*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def strip(text):
    return STRIP.sub(lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text)


SCOPE_KW = re.compile(r'\b(namespace|class|struct|union|enum)\b[^;{}()]*$')


def functions(text):
    """Yields (line, length) of each function body at namespace/class scope."""
    code = strip(text)
    stack = []  # per open brace: 'scope' | 'func' | 'other', with start offset
    i = 0
    last_end = 0
    while i < len(code):
        c = code[i]
        if c == '{':
            head = code[last_end:i]
            inside_func = any(k == 'func' for k, _ in stack)
            kind = 'other'
            if not inside_func:
                h = head.strip()
                if SCOPE_KW.search(h) or h.endswith('extern "C"'):
                    kind = 'scope'
                elif re.search(r'\)\s*(const|noexcept|override|final|mutable|&|&&|\s|->\s*[\w:<>,*& ]+|'
                               r':\s*[\w:]+\s*(\([^;]*\)|\{[^;]*\})\s*,?)*$', h) and not re.search(
                                   r'\b(if|for|while|switch|catch)\s*\([^;]*\)\s*$', h):
                    kind = 'func'
                elif re.search(r'\)\s*:\s*[^;]*$', h):  # constructor with an initialiser list
                    kind = 'func'
                else:
                    kind = 'scope' if not stack or stack[-1][0] == 'scope' else 'other'
            stack.append((kind, i))
            last_end = i + 1
        elif c == '}':
            if stack:
                kind, start = stack.pop()
                if kind == 'func':
                    l0 = code.count('\n', 0, start) + 1
                    l1 = code.count('\n', 0, i) + 1
                    yield l0, l1 - l0 + 1
            last_end = i + 1
        elif c == ';':
            last_end = i + 1
        i += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--max-file', type=int, default=700)
    ap.add_argument('--max-function', type=int, default=100)
    ap.add_argument('dirs', nargs='*', default=['src', 'tools'])
    a = ap.parse_args()
    bad = 0
    for d in a.dirs:
        for root, _, files in os.walk(d):
            for f in sorted(files):
                if not f.endswith(('.cpp', '.h', '.hpp', '.cc')):
                    continue
                p = os.path.join(root, f)
                text = open(p, encoding='utf-8', errors='replace').read()
                n = text.count('\n')
                if n > a.max_file:
                    print(f'{p}:1: file has {n} lines (limit {a.max_file})')
                    bad += 1
                for line, length in functions(text):
                    if length > a.max_function:
                        print(f'{p}:{line}: function body of {length} lines (limit {a.max_function})')
                        bad += 1
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
