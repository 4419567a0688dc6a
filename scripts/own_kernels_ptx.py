"""Snapshot and compare the PTX of the own CuTe DSL kernels, for behaviour-preserving refactors.

A refactor of kernel/own/ (argument grouping, helper moves) must not change what the kernels
compile to. This script compiles every configuration the compile-only tests cover, one
representative each (sm_90a: bf16/fp16, D = 64/128, causal, each knob and knob combination,
the varlen, window and persistent paths, FP8 with both constant sets; sm_100a: the 8
configurations), writes each one's PTX with the names normalized, and compares two snapshots::

    PYTHONPATH=src python scripts/own_kernels_ptx.py dump /tmp/after [--only REGEX]
    PYTHONPATH=/tmp/before/src python scripts/own_kernels_ptx.py dump /tmp/before
    python scripts/own_kernels_ptx.py compare /tmp/before /tmp/after

No GPU is needed (``--gpu-arch`` is passed). ``compare`` exits 1 on any difference and prints
the first differing lines of each file. Normalized: the kernel's mangled entry name (it spells
the Python qualified names and argument types of the entry, which a refactor renames), and
the header comment with the tool versions.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# sm_90a knob sets: the adapters' default, the baseline, and each knob the tests compile.
SM90_KNOBS = {
    "default": {"overlap": True, "pingpong": True, "longest_first": True, "smem_epilogue": True},
    "baseline": {},
    "overlap": {"overlap": True},
    "pingpong": {"overlap": True, "pingpong": True},
    "lpt": {"overlap": True, "longest_first": True},
    "smemepi": {"smem_epilogue": True},
    "persistent": {"overlap": True, "persistent": True},
    "persistent-plain": {"persistent": True},
}
PATHS = {"plain": {}, "varlen": {"varlen": True}, "varlen+window": {"varlen": True, "window": True}}
# FP8: (max_offset_log2, rescale_threshold_log2) as tests/kernel/test_own_sm90_fp8.py names them.
FP8_CONSTANTS = {"fixed": (8.0, 0.0), "fa4": (8.0, 4.0)}


def sm90_configs() -> dict[str, Callable[[], object]]:
    """name -> a function compiling that configuration (the compiled object)."""
    from attention_crossval.kernel.adapters.own_sm90 import make_kernel

    configs: dict[str, Callable[[], object]] = {}

    def add(name: str, dtype: str, d: int, causal: bool, path: str, **knobs: bool) -> None:
        def build(options: str) -> object:
            kernel = make_kernel(dtype, d, causal, **knobs)
            return kernel.compile(options=options, **PATHS[path])

        configs[f"sm90-{name}"] = build

    for dtype in ("bfloat16", "float16"):
        for d in (64, 128):
            for causal in (False, True):
                tag = f"{dtype[:2]}-d{d}-{'causal' if causal else 'full'}"
                for path in PATHS:
                    add(f"{tag}-default-{path}", dtype, d, causal, path,
                        m192=d == 64, **SM90_KNOBS["default"])  # fmt: skip
                add(f"{tag}-baseline-plain", dtype, d, causal, "plain")
    for knobs in ("overlap", "pingpong", "lpt", "smemepi", "persistent", "persistent-plain"):
        for path in ("plain", "varlen+window"):
            add(f"bf-d128-causal-{knobs}-{path}", "bfloat16", 128, True, path,
                **SM90_KNOBS[knobs])  # fmt: skip
    add("fp-d64-full-persistent-varlen", "float16", 64, False, "varlen", persistent=True)
    add("bf-d64-causal-pingpong3-plain", "bfloat16", 64, True, "plain", m192=True,
        **SM90_KNOBS["pingpong"])  # fmt: skip
    return configs


def fp8_configs() -> dict[str, Callable[[], object]]:
    from attention_crossval.kernel.adapters.own_sm90 import consumer_warpgroups
    from attention_crossval.kernel.own.sm90.fwd import FlashAttentionForwardSm90

    configs: dict[str, Callable[[], object]] = {}
    adapter = {"overlap": True, "pingpong": True, "longest_first": True}

    def add(name: str, dtype: str, d: int, causal: bool, constants: str, **knobs: bool) -> None:
        offset, threshold = FP8_CONSTANTS[constants]

        def build(options: str) -> object:
            kernel = FlashAttentionForwardSm90(
                dtype, d, causal, num_consumer_wg=consumer_warpgroups(d, m192=bool(knobs)),
                max_offset_log2=offset, rescale_threshold_log2=threshold, **knobs,
            )  # fmt: skip
            return kernel.compile(options=options)

        configs[f"fp8-{name}"] = build

    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        for d in (64, 128):
            for causal in (False, True):
                tag = f"{dtype[-4:]}-d{d}-{'causal' if causal else 'full'}"
                add(f"{tag}-fixed-adapter", dtype, d, causal, "fixed", **adapter)
    add("e4m3-d128-causal-fa4-adapter", "float8_e4m3fn", 128, True, "fa4", **adapter)
    add("e4m3-d128-causal-fixed-baseline", "float8_e4m3fn", 128, True, "fixed")
    add("e5m2-d64-full-fa4-baseline", "float8_e5m2", 64, False, "fa4")
    return configs


def sm100_configs() -> dict[str, Callable[[], object]]:
    from attention_crossval.kernel.own.sm100.fwd import FlashAttentionForwardSm100

    configs: dict[str, Callable[[], object]] = {}
    for dtype in ("bfloat16", "float16"):
        for d in (64, 128):
            for causal in (False, True):

                def build(options, dtype=dtype, d=d, causal=causal):  # noqa: ANN001
                    return FlashAttentionForwardSm100(dtype, d, causal).compile(options=options)

                configs[f"sm100-{dtype[:2]}-d{d}-{'causal' if causal else 'full'}"] = build
    return configs


MANGLED = re.compile(r"\bkernel_cutlass_\w+")
HEADER = re.compile(r"^//.*$", re.MULTILINE)


def normalize(ptx: str) -> str:
    """The PTX with the mangled entry names numbered in order of appearance and the comment
    lines (compiler versions) dropped."""
    names: dict[str, str] = {}
    ptx = MANGLED.sub(lambda m: names.setdefault(m.group(0), f"ENTRY{len(names)}"), ptx)
    return HEADER.sub("", ptx)


PARAM = re.compile(r"^\s*\.param (?P<decl>[^\n]*?)(?P<name>ENTRY\d+)(?P<size>\[\d+\])?,?$", re.M)


def params_by_type(ptx: str) -> str:
    """:func:`normalize`'s text with each kernel parameter named by its declaration and its rank
    among the parameters declared alike (``.f32 #0``, ``.align 64 .b8 [128] #2``) and the
    declarations sorted: the text a kernel compiles to whatever the order of its parameters of
    different declarations. Parameters declared alike keep their order, so swapping two TMA
    descriptors or two tensors still shows."""
    names: dict[str, str] = {}
    seen: dict[str, int] = {}
    for match in PARAM.finditer(ptx):
        decl = f"{match['decl'].strip()} {match['size'] or ''}".strip()
        names[match["name"]] = f"<{decl} #{seen.setdefault(decl, 0)}>"
        seen[decl] += 1
    declarations = sorted(f".param {names[m['name']]}" for m in PARAM.finditer(ptx))
    body = PARAM.sub("", ptx)
    body = re.sub(r"\bENTRY\d+\b", lambda m: names.get(m.group(0), m.group(0)), body)
    return "\n".join(declarations) + "\n" + body


def ptx_text(compiled: object) -> str:
    """The PTX of a compile with ``--keep-ptx`` (the DSL gives the text or its file)."""
    ptx = compiled.artifacts.PTX
    return Path(ptx).read_text() if "\n" not in ptx and Path(ptx).is_file() else ptx


def dump(out: Path, only: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    configs = {**sm90_configs(), **fp8_configs(), **sm100_configs()}
    for name, build in configs.items():
        if not re.search(only, name):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            ptx = ptx_text(build(f"--keep-ptx --dump-dir={tmp}"))
        (out / f"{name}.ptx").write_text(normalize(ptx))
        print(name, flush=True)


def compare(before: Path, after: Path) -> int:
    names_before = {p.name for p in before.glob("*.ptx")}
    names_after = {p.name for p in after.glob("*.ptx")}
    identical, differ, reordered = 0, 0, []
    for name in sorted(names_before ^ names_after):
        print(f"only in {'before' if name in names_before else 'after'}: {name}")
        differ += 1
    for name in sorted(names_before & names_after):
        a, b = (before / name).read_text(), (after / name).read_text()
        if a == b:
            identical += 1
        elif params_by_type(a) == params_by_type(b):
            reordered.append(name)
        else:
            differ += 1
            diff = difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
            print(f"DIFFERS: {name}\n" + "\n".join(list(diff)[:20]))
    for name in reordered:
        print(f"same but the order of differently declared parameters: {name}")
    print(f"{identical} identical, {len(reordered)} same up to parameter order, {differ} differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump_parser = sub.add_parser("dump", help="compile every configuration, write its PTX")
    dump_parser.add_argument("out", type=Path)
    dump_parser.add_argument("--only", default="", help="regex on configuration names")
    compare_parser = sub.add_parser("compare", help="compare two dump folders")
    compare_parser.add_argument("before", type=Path)
    compare_parser.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.out, args.only)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
