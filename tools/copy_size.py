#!/usr/bin/env python3
"""What a student pastes to reuse one function of this project: the definitions it reaches, whole, plus imports.

Usage (from the repository's root):
  python tools/copy_size.py certify:certify train_ours:ours_loss ...    one line per block: lines, code lines,
                                                                          definitions and their names
  python tools/copy_size.py grid:grid_certify grid:grid_plan --emit FILE   also write the pasted file

A block is MODULE:NAME, MODULE.py at the repository's root. Nothing is run: the closure is read from the code.
It holds every top-level function, class or constant that the block names, bare or as `module.name` of another
of the project's modules, and so on. Lines are counted as pasted: each definition whole (its docstring and
comments too) plus the import lines the pasted code uses; `code` leaves out docstrings, comments and blank
lines. The pasted file has the definitions in dependency order, one file, `module.` prefixes dropped.
docs/python.md quotes these counts; tests/test_paste.py holds each block to a budget and runs the pasted file.
"""
import ast
import io
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_module(path):
    """{top-level name: (node, source segment)} and the import nodes of one module (decorators included)."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines, defs, imports = source.splitlines(), {}, []
    for node in ast.parse(source).body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        segment = "\n".join(lines[first - 1:node.end_lineno])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = (node, segment)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        defs[n.id] = (node, segment)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
    return defs, imports


def project_modules(root=ROOT):
    """{module name: parse_module(...)} of the .py files at the root (tests and tools live elsewhere)."""
    return {f[:-3]: parse_module(os.path.join(root, f)) for f in sorted(os.listdir(root)) if f.endswith(".py")}


def closure(roots, code):
    """The (module, name) definitions the roots reach, each after the ones it needs; one per source segment (a
    tuple assignment defines several names at once)."""
    seen, order = set(), []

    def visit(key):
        module, name = key
        if key in seen or module not in code or name not in code[module][0]:
            return
        seen.add(key)
        for n in ast.walk(code[module][0][name][0]):
            if isinstance(n, ast.Name):
                visit((module, n.id))
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in code:
                visit((n.value.id, n.attr))
        order.append(key)

    for root in roots:
        visit(tuple(root.split(":", 1)))
    segments = {}
    for module, name in order:
        segments.setdefault((module, code[module][0][name][1]), (module, name))
    return list(segments.values())


def import_lines(keys, code):
    """The import lines of the modules involved that the pasted definitions use (project modules dropped)."""
    used = {n.id for module, name in keys for n in ast.walk(code[module][0][name][0]) if isinstance(n, ast.Name)}
    lines = []
    for module in dict.fromkeys(m for m, _ in keys):
        for node in code[module][1]:
            for alias in node.names:
                bound = (alias.asname or alias.name).split(".")[0]
                if bound in used and bound not in code:
                    line = (f"from {node.module} import {alias.name}" if isinstance(node, ast.ImportFrom)
                            else f"import {alias.name}") + (f" as {alias.asname}" if alias.asname else "")
                    if line not in lines:
                        lines.append(line)
    return lines


def pasted(roots, code=None):
    """(the pasted file's text, the lines counted, the definitions as (module, name))."""
    code = project_modules() if code is None else code
    keys = closure(roots, code)
    parts = []
    for module, name in keys:
        segment = code[module][0][name][1]
        for other in code:   # one file: `common.check` becomes `check`
            segment = re.sub(rf"\b{other}\.([A-Za-z_]\w*)", lambda m, o=other: m.group(1) if m.group(1) in code[o][0]
                             else m.group(0), segment)
        parts.append(segment)
    imports = import_lines(keys, code)
    count = len(imports) + sum(len(code[m][0][n][1].splitlines()) for m, n in keys)
    return "\n".join(imports) + "\n\n\n" + "\n\n\n".join(parts) + "\n", count, keys


def code_lines(text):
    """Lines of a source text that hold code: no docstring, comment or blank line."""
    docs = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docs)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    emit = None
    if "--emit" in argv:
        i = argv.index("--emit")
        if i + 1 >= len(argv):
            print("copy_size.py: --emit needs a file name", file=sys.stderr)
            return 2
        emit = argv[i + 1]
        del argv[i:i + 2]
    code = project_modules()
    for root in argv:
        module, _, name = root.partition(":")
        if module not in code or name not in code[module][0]:
            print(f"copy_size.py: no top-level {name!r} in {module}.py (a block is MODULE:NAME)", file=sys.stderr)
            return 2
    for root in argv:
        text, count, keys = pasted([root], code)
        print(f"{root}\tlines {count}\tcode {code_lines(text)}\tdefinitions {len(keys)}\t" +
              " ".join(f"{m}.{n}" for m, n in keys))
    if emit:
        text, count, _ = pasted(argv, code)
        sys.path.insert(0, ROOT)
        import machinery   # the project's one guard of outputs: never over an input or someone's edit
        machinery.write_text_output(emit, "pasted block", text)
        print(f"wrote {emit} ({count} lines)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    import machinery   # one line and exit 2 for a refused --emit (a folder, an input, someone's file)
    machinery.run(lambda: sys.exit(main()), exit_process=True)
