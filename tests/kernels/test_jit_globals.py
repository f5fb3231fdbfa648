"""Every Triton kernel reads only constexpr globals. The interpreter (CI) accepts a plain int global,
but a kernel compiled for the GPU raises a CompilationError on it: this catches that on the CPU."""
import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import nanovllm.kernels


def _kernels():
    for info in pkgutil.iter_modules(nanovllm.kernels.__path__):
        module = importlib.import_module(f"nanovllm.kernels.{info.name}")
        for name, obj in vars(module).items():
            # Under TRITON_INTERPRET=1 (CI) @triton.jit gives InterpretedFunctions.
            if isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction)) and obj.fn.__module__ == module.__name__:
                yield f"{info.name}.{name}", obj.fn


def _plain_globals(fn) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)) or node.id in local:
            continue
        if node.id not in fn.__globals__:
            continue  # a builtin (range, min, ...)
        value = fn.__globals__[node.id]
        allowed = (types.ModuleType, triton.runtime.JITFunction, tl.constexpr, tl.dtype, type)
        if not isinstance(value, allowed) and not callable(value):
            found.append(f"{node.id} ({type(value).__name__})")
    return sorted(set(found))


def test_kernels_read_only_constexpr_globals():
    kernels = list(_kernels())
    assert len(kernels) > 20  # the scan found the kernels
    offenders = {name: bad for name, fn in kernels if (bad := _plain_globals(fn))}
    assert not offenders, f"wrap these globals in tl.constexpr(...): {offenders}"
