"""Programmatic dependent launch lets a kernel start while its predecessor still runs, so whatever a
kernel reads before `pdl_prologue()` must be something no kernel writes (kernels/pdl.py). The CPU
interpreter ignores PDL, so a load moved above the wait would pass every other CPU test: this test
reads the kernels' source instead and holds each one to the pointers it may read early."""
import ast
import pathlib

import nanovllm.kernels.pdl as pdl

KERNELS = pathlib.Path(pdl.__file__).parent

# Pointer arguments a kernel may read before its wait: weights and step inputs copied from the host.
EARLY_READS = {
    "_decode_split_kernel": {"order_ptr", "seq_lens_ptr", "block_tables_ptr"},
    "_rms_norm_kernel": {"w_ptr"},
    "_rms_norm_quant_kernel": {"w_ptr"},
    "_qkv_rope_kernel": {"pos_ptr", "cs_ptr", "slot_ptr"},
    "_qk_norm_rope_kernel": {"pos_ptr", "cs_ptr"},
    "_prefill_kernel": {"cu_seqlens_q_ptr", "seq_lens_ptr"},
}


def _kernels():
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                yield path.name, node


def _is_prologue(stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "pdl_prologue")


def _before_prologue(body):
    """The statements executed before the pdl_prologue() call (None: no call at this level)."""
    for i, stmt in enumerate(body):
        if _is_prologue(stmt):
            return body[:i]
    return None


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _early_pointer_reads(fn: ast.FunctionDef) -> set[str]:
    """Pointer arguments (named *_ptr in every kernel) whose memory is read (tl.load / tl.atomic_*)
    before the wait, following local names back to the arguments they are computed from."""
    before = _before_prologue(fn.body)
    assert before is not None, f"{fn.name} does not call pdl_prologue() in its body"
    sources: dict[str, set[str]] = {}  # local name -> argument names it derives from
    args = {a.arg for a in fn.args.args if a.arg.endswith("_ptr")}  # the kernels' naming of pointers
    read: set[str] = set()

    def origin(names):
        out = set()
        for n in names:
            out |= sources.get(n, {n} & args)
        return out

    for stmt in before:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    node.func.attr == "load" or node.func.attr.startswith("atomic_")) and node.args:
                read |= origin(_names(node.args[0]))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):  # a jit helper may read what it is given
                read |= origin(set().union(*(_names(a) for a in node.args), set()))
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in _names(target):
                        sources[name] = sources.get(name, set()) | origin(_names(node.value))
    return read


def test_every_kernel_waits_for_its_predecessor():
    found = list(_kernels())
    assert len(found) >= 10  # the test must see the kernels it guards
    for file, fn in found:
        early = _early_pointer_reads(fn)
        allowed = EARLY_READS.get(fn.name, set())
        assert early <= allowed, (f"{file}:{fn.name} reads {sorted(early - allowed)} before pdl_prologue(); "
                                  "only memory no kernel writes may be read before the wait (kernels/pdl.py)")


def test_the_guard_sees_early_reads():
    src = '''
@triton.jit
def _x_kernel(a_ptr, b_ptr, n):
    base = b_ptr + n
    v = tl.load(base + 1)
    pdl_prologue()
    w = tl.load(a_ptr)
'''
    fn = ast.parse(src).body[0]
    assert _early_pointer_reads(fn) == {"b_ptr"}
    helper = src.replace("v = tl.load(base + 1)", "v = _helper(base, n)")
    assert _early_pointer_reads(ast.parse(helper).body[0]) == {"b_ptr"}
