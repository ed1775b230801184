#!/usr/bin/env python3
"""Holds every kernel in kernels/gpu to portability.h's rule for early launch.

A kernel may start while the kernel ahead of it on its stream is still running (early_launch), so
each kernel's first statement at the top level of its body is FLASHD_GRID_BEGIN(): before it, a
kernel may only declare shared memory, compute constants from its arguments and ask for its
weights (Prefetch...). A kernel that reads or writes before it, returns before it, or waits only
inside a branch fails here. Usage: check-grid-begin.py [ROOT] (default: the current folder).
"""
import pathlib
import re
import sys

ALLOWED = (
    re.compile(r"FLASHD_DYNAMIC_SHARED\("),
    re.compile(r"__shared__\s"),
    re.compile(r"constexpr\s"),
    re.compile(r"Prefetch\w*(<[^;]*?>)?\("),
)
CONST = re.compile(r"const\s+[\w:<>, ]+?\s+\w+\s*=(.*);$", re.S)


def allowed(statement):
    if any(p.match(statement) for p in ALLOWED):
        return True
    # const T name = ...; from the arguments: nothing indexed or followed through a pointer.
    m = CONST.match(statement)
    return bool(m) and "[" not in m.group(1) and "->" not in m.group(1)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: " " * len(m.group(0)), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def body_statements(text, open_brace):
    """The top-level statements of the body opening at text[open_brace], until it closes."""
    statements, depth, start, i = [], 0, open_brace + 1, open_brace + 1
    while i < len(text):
        ch = text[i]
        if ch in "({[":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "}":
            if depth == 0:
                tail = text[start:i].strip()
                if tail:
                    statements.append(tail)
                return statements
            depth -= 1
            if depth == 0:  # A block statement (if, for, a lambda's body...) ends here.
                statements.append(text[start:i + 1].strip())
                start = i + 1
        elif ch == ";" and depth == 0:
            statements.append(text[start:i + 1].strip())
            start = i + 1
        elif ch == "#" and text[start:i].strip() == "":
            end = text.index("\n", i)
            statements.append(text[i:end].strip())
            start = i = end
        i += 1
    raise ValueError("unterminated body")


def check(path):
    problems, count = [], 0
    text = strip_comments(path.read_text())
    for m in re.finditer(r"__global__\s", text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if text[line_start:m.start()].lstrip().startswith("#"):
            continue  # portability.h's own definitions.
        open_brace = text.index("{", m.end())
        name = re.findall(r"(\w+)\s*\(", re.sub(r"__launch_bounds__\([^)]*\)", "",
                                                text[m.end():open_brace]))
        where = f"{path}:{text.count(chr(10), 0, m.start()) + 1} {name[0] if name else '?'}"
        count += 1
        for statement in body_statements(text, open_brace):
            if statement.startswith("FLASHD_GRID_BEGIN()"):
                break
            if not allowed(statement):
                first = " ".join(statement.split())[:80]
                problems.append(f"{where}: '{first}' before FLASHD_GRID_BEGIN()")
                break
        else:
            problems.append(f"{where}: no FLASHD_GRID_BEGIN() at the top of its body")
    return problems, count


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    files = sorted((root / "kernels" / "gpu").glob("*.cu")) + sorted(
        (root / "kernels" / "gpu").glob("*.h"))
    problems, kernels = [], 0
    for f in files:
        p, n = check(f)
        problems += p
        kernels += n
    for p in problems:
        print(p)
    if kernels == 0:
        print("no kernels found under", root / "kernels" / "gpu")
        return 1
    print(f"{kernels} kernels, {len(problems)} not starting with FLASHD_GRID_BEGIN()")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
