"""`python -m hf_vegas.hub export DIR`: a Hub `custom_generate` folder that runs without hf_vegas installed.

transformers (5.17 to 5.23 alike) loads a repository's `custom_generate/generate.py` with its dynamic-module loader
(`transformers.dynamic_module_utils`), which
- copies (local folder) or downloads (Hub) only the files that `from .<file> import` lines name, found by a regular
  expression over each file's text and followed from file to file, each as `custom_generate/<file>.py`: it has no
  notion of sub-packages, `from . import <module>` or `from ..<module> import`;
- refuses the folder unless every package a fetched file imports at its top level is installed.

So the folder holds the hf_vegas modules `generate_from_name` needs, flat and otherwise unchanged: only their relative
import statements are rewritten, mechanically (`hf_vegas/ops/backend.py` becomes `ops_backend.py`,
`from .ops import backend` becomes `from . import ops_backend as backend`, `from ..config import` becomes
`from .config import`), and `generate.py` names every file in a `from .<file> import` line that the loader reads and
Python never runs. The package's `__init__` is left out: it patches transformers for the short name, which loading a
Hub folder must not do.

The kernel package's plain-PyTorch ops (`hf_vegas_kernels.naive`, imported as `from hf_vegas_kernels import naive`)
are copied the same way, as `hf_vegas_kernels_naive.py`. Its Triton kernels are not: every Triton file imports `triton`
at its top level, so the loader would refuse the whole folder on a machine without Triton. The folder's
`vegas_backend="auto"` uses them where `hf_vegas_kernels` is importable, and the plain-PyTorch ops elsewhere (the same
tokens; slower on CUDA).
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import sys
from pathlib import Path

import hf_vegas_kernels

from .hub_readme import ExportError, folder_readme

SOURCE = Path(__file__).resolve().parent
# Modules are tuples of names: relative to hf_vegas (`("ops", "backend")`), or in the kernel package, whose modules
# that need only torch are copied too (`("hf_vegas_kernels", "naive")`).
KERNELS = "hf_vegas_kernels"
KERNELS_SOURCE = Path(hf_vegas_kernels.__file__).resolve().parent
TRITON_FREE_KERNEL_MODULES = ("naive",)
ENTRY = ("names",)  # `generate_from_name`: the string form's full replacement of `generate`
# What the folder's code imports at its top level. One comparison per line: transformers' requirements check reads
# `name<op>version` and would keep only the first bound of `transformers>=5.17,<6`. Same bounds as pyproject.toml.
REQUIREMENTS = ("transformers>=5.17", "torch>=2.5")
COMMAND = "python -m hf_vegas.hub export"


def export_hub_folder(directory, overwrite: bool = False) -> Path:
    """Write the Hub folder into `directory`: `README.md` and `custom_generate/` (`generate.py`, `requirements.txt` and
    the hf_vegas modules it needs). Load it with `model.generate(..., custom_generate=str(directory),
    trust_remote_code=True)`, or upload `directory` as a Hub repository.

    `overwrite=True` replaces an existing `custom_generate/` and `README.md` (a previous export); otherwise their
    presence is an error. Returns `directory`.
    """
    directory = Path(directory)
    code, readme = directory / "custom_generate", directory / "README.md"
    existing = [str(path) for path in (code, readme) if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing} already exist(s); pass overwrite=True (--force) to replace them.")
    modules = _closure()
    files = {_flat(module): _rewrite(module) for module in modules}
    if len(files) != len(modules) or "generate" in files:
        raise ExportError(f"flat module names collide: {sorted(_flat(m) for m in modules)}")
    if code.exists():
        shutil.rmtree(code)
    code.mkdir(parents=True)
    for name, text in files.items():
        (code / f"{name}.py").write_text(text, encoding="utf-8")
    (code / "generate.py").write_text(_generate_py(sorted(files)), encoding="utf-8")
    (code / "requirements.txt").write_text(_requirements_txt(), encoding="utf-8")
    readme.write_text(folder_readme(COMMAND, REQUIREMENTS), encoding="utf-8")
    return directory


def _path(module: tuple[str, ...]) -> Path:
    return KERNELS_SOURCE.joinpath(*module[1:]) if module[:1] == (KERNELS,) else SOURCE.joinpath(*module)


def _file(module: tuple[str, ...]) -> Path:
    return _path(module).with_suffix(".py")


def _shown(module: tuple[str, ...]) -> str:
    """`module`'s path as the export's comments and errors name it: `hf_vegas/ops/backend.py`."""
    return "/".join(module if module[:1] == (KERNELS,) else ("hf_vegas", *module)) + ".py"


def _is_package(module: tuple[str, ...]) -> bool:
    return (_path(module) / "__init__.py").is_file()


def _kernel_modules(module: tuple[str, ...], node: ast.ImportFrom) -> list[tuple[str, ...]] | None:
    """The kernel package's modules an absolute `from hf_vegas_kernels import naive` binds; None for any other
    absolute import. Only modules that need only torch can be copied."""
    if node.level != 0 or node.module != KERNELS:
        return None
    names = [alias.name for alias in node.names]
    if not set(names) <= set(TRITON_FREE_KERNEL_MODULES):
        raise ExportError(
            f"{_shown(module)}: line {node.lineno} imports {names} from {KERNELS}; only its modules that need no "
            f"Triton ({list(TRITON_FREE_KERNEL_MODULES)}) can be copied into the folder."
        )
    return [(KERNELS, name) for name in names]


def _flat(module: tuple[str, ...]) -> str:
    return "_".join(module)


def _imported(module: tuple[str, ...], node: ast.ImportFrom) -> tuple[list[tuple[str, ...]], bool]:
    """The hf_vegas modules a relative `from` import in `module` reads, and whether they are submodules it binds by
    name (`from .ops import backend`) rather than one module whose names it imports (`from .config import X`)."""
    package = module[:-1]
    if node.level - 1 > len(package):
        raise ExportError(f"{_shown(module)}: line {node.lineno} imports from above the hf_vegas package.")
    base = package[: len(package) - (node.level - 1)]
    target = base + tuple(node.module.split(".")) if node.module else base
    if not _is_package(target):
        if not _file(target).is_file():
            raise ExportError(f"{_shown(module)}: line {node.lineno} imports {'.'.join(target)}, which has no file.")
        return [target], False
    submodules = [target + (alias.name,) for alias in node.names]
    for submodule in submodules:
        if not _file(submodule).is_file():  # a name defined in the package's `__init__`, or `*`
            raise ExportError(
                f"{_shown(module)}: line {node.lineno} imports {submodule[-1]!r} from the package "
                f"{'.'.join(('hf_vegas', *target))}; the flat export can rewrite only imports of its submodules."
            )
    return submodules, True


def _parse(module: tuple[str, ...]) -> tuple[str, ast.Module]:
    source = _file(module).read_text(encoding="utf-8")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
            _kernel_modules(module, node)  # a kernel module that needs Triton is an error
        if any(name == "hf_vegas" or name.startswith("hf_vegas.") for name in names):
            raise ExportError(f"{_shown(module)}: line {node.lineno} imports hf_vegas by its absolute name.")
        if any(name == KERNELS or name.startswith(f"{KERNELS}.") for name in names) and not (
                isinstance(node, ast.ImportFrom) and node.module == KERNELS):
            raise ExportError(  # `import hf_vegas_kernels`, `from hf_vegas_kernels.naive import f`: not rewritten
                f"{_shown(module)}: line {node.lineno} imports {KERNELS} in a form the flat export cannot rewrite; "
                f"write `from {KERNELS} import <module>` (a dynamic import, `importlib.import_module`, is left alone)."
            )
    return source, tree


def _closure() -> list[tuple[str, ...]]:
    """Every hf_vegas module the entry point imports, directly or not, through relative imports."""
    seen, pending = set(), [ENTRY]
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        _, tree = _parse(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                pending.extend(_imported(module, node)[0])
            elif isinstance(node, ast.ImportFrom):
                pending.extend(_kernel_modules(module, node) or [])
    return sorted(seen)


def _rewrite(module: tuple[str, ...]) -> str:
    """`module`'s source with each relative import statement rewritten for the flat folder; nothing else changes."""
    source, tree = _parse(module)
    data = source.encode("utf-8")  # ast's column offsets count UTF-8 bytes
    line_starts = [0]
    for line in data.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level > 0:
            targets, submodules = _imported(module, node)
        elif kernel_modules := _kernel_modules(module, node):
            targets, submodules = kernel_modules, True
        else:
            continue
        start = line_starts[node.lineno - 1] + node.col_offset
        end = line_starts[node.end_lineno - 1] + node.end_col_offset
        statement = data[start:end].decode("utf-8")
        if submodules:
            bound = []
            for target, alias in zip(targets, node.names):
                name = alias.asname or alias.name
                bound.append(_flat(target) if name == _flat(target) else f"{_flat(target)} as {name}")
            new = f"from . import {', '.join(bound)}"
            if node.col_offset + len(new) > 119:
                new = "from . import (\n" + "".join(f"{' ' * (node.col_offset + 4)}{b},\n" for b in bound)
                new += " " * node.col_offset + ")"
        else:
            new = re.sub(r"^from\s+[.\w]+\s+import", f"from .{_flat(targets[0])} import", statement, count=1)
        edits.append((start, end, new.encode("utf-8")))
    for start, end, new in sorted(edits, reverse=True):
        data = data[:start] + new + data[end:]
    header = (
        f"# {_shown(module)}, copied by `{COMMAND}`, its package imports rewritten for this folder.\n"
    )
    return header + data.decode("utf-8")


def _generate_py(files: list[str]) -> str:
    manifest = "\n".join(f"    from .{name} import *  # noqa: F401,F403" for name in files)
    return f'''"""Vegas self-speculative decoding as a Hub `custom_generate`:
`model.generate(..., custom_generate="<org>/vegas", trust_remote_code=True)`, or this folder's path.

Exported by `{COMMAND}`: the other files here are hf_vegas's own modules, copied with
their relative imports rewritten for this flat folder. They need only transformers and torch (requirements.txt).
"""

from typing import TYPE_CHECKING

from .names import generate_from_name

if TYPE_CHECKING:
    # Never runs. transformers' loader copies (or downloads from the Hub) only the files named by `from .<file>
    # import` lines; the modules below import each other with `from . import <file>` too, which it does not read.
{manifest}


def generate(model, **generate_arguments):
    """Full replacement of `generate`: the same arguments, plus the `vegas_*` ones (README.md)."""
    return generate_from_name(model, **generate_arguments)
'''


def _requirements_txt() -> str:
    return "\n".join([
        *REQUIREMENTS,
        "# Optional, on CUDA: the Triton kernels (`hf_vegas_kernels`, with `triton`). Without them the folder",
        "# runs the plain-PyTorch ops: the same tokens, slower.",
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_vegas.hub", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a self-contained Hub custom_generate folder")
    export.add_argument("directory", type=Path, help="where to write README.md and custom_generate/")
    export.add_argument("--force", action="store_true", help="replace custom_generate/ and README.md if present")
    args = parser.parse_args(argv)
    directory = export_hub_folder(args.directory, overwrite=args.force)
    print(
        f"Wrote {directory}. Load it with model.generate(..., custom_generate={str(directory)!r}, "
        "trust_remote_code=True), or upload the folder as a Hub repository."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
