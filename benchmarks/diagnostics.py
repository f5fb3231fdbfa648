"""The diagnostic switches of bench.py (`--log-compiles`, `--alloc-trace`, `--profile`, `--clock-trace`): what
each records or prints around the timed run, kept apart from the benchmark itself."""
import gc
import os
import re
import time

import torch


def log_triton_compiles():
    import triton
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        print("--log-compiles needs triton >= 3.4 (triton.knobs)")
        return

    def hook(*, repr, **_):
        print(f"[triton compile at {time.perf_counter():.3f}] {repr}", flush=True)
        return False
    knobs.runtime.jit_cache_hook = hook


class GcPauses:
    """The cyclic garbage collector's pauses from now on (gc.callbacks), by generation."""

    def __init__(self):
        self.times, self.generations, self.starts, self._start = [], [], [], 0.0
        gc.callbacks.append(self.callback)

    def callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.times.append(time.perf_counter() - self._start)
            self.generations.append(info["generation"])
            self.starts.append(self._start)

    def timeline(self, origin: float) -> str:
        """Each pause as generation@start:duration, in ms from `origin`."""
        return " ".join(f"{g}@{1e3 * (s - origin):.0f}:{1e3 * t:.1f}"
                        for g, s, t in zip(self.generations, self.starts, self.times))


def print_segment_allocs(snapshot, frames: int = 4):
    """The device allocations (new segments) of a recorded run, with the Python frames that made them."""
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "segment_alloc":
                where = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in event.get("frames", [])
                         if "nanovllm" in f["filename"] or "bench" in f["filename"]][:frames]
                print(f"segment_alloc {event['size'] / 2**20:8.1f} MiB at " + " <- ".join(where))


def device_rows(prof) -> list[tuple[str, int, float]]:
    """(name, calls, device microseconds) of everything a torch profiler saw run on the device
    (kernels, copies, memsets), longest first."""
    from torch.autograd import DeviceType
    rows = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])


# Kinds of device work, by kernel name (first match wins): where a step's time goes.
KERNEL_KINDS = (
    ("router+sort (top-k, align)", r"_moe_topk_kernel|_moe_align_kernel"),
    ("expert GEMMs", r"_moe_gate_up_kernel|_moe_down_kernel"),
    ("attention", r"_decode_split_kernel|_merge_kernel|_prefill_kernel|_balanced_decode"),
    ("qkv + rotary + K/V store", r"_qkv_rope_kernel|_qk_norm_rope|store_kv"),
    ("dense GEMMs (ours)", r"_gemm_kernel"),
    ("library GEMMs (incl. the MoE router)", r"gemm|nvjet|cutlass|xmma|gemv|splitK"),
    ("RMSNorm, SiLU, elementwise", r"_rms_norm|_silu|elementwise|vectorized|reduce_kernel|index"),
    ("sampling", r"sample|_top_k|_top_p|_resolve"),
)


def kernel_kinds(rows) -> list[tuple[str, float]]:
    """(kind, device seconds) of device_rows(), in KERNEL_KINDS order, the rest as "other"."""
    totals = {name: 0.0 for name, _ in KERNEL_KINDS}
    totals["other"] = 0.0
    for name, _, us in rows:
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name)), "other")
        totals[kind] += us / 1e6
    return [(k, t) for k, t in totals.items() if t > 0]


def profile_run(llm, prompts, params, top: int = 25, trace: str | None = None, steps: int | None = None):
    """One generate under the CUDA profiler: how much of the wall time the device spends in kernels
    (the rest is the host not keeping up), by kind of work (KERNEL_KINDS; per step over `steps`) and
    which kernels take it; `trace`: a chrome trace file for scripts/trace_gaps.py (where the idle time sits)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if trace:
        prof.export_chrome_trace(trace)
    rows = device_rows(prof)
    busy = sum(r[2] for r in rows) / 1e6
    print(f"profile: wall {wall:.3f}s (under the profiler), device busy {busy:.3f}s, idle {wall - busy:.3f}s")
    for kind, seconds in kernel_kinds(rows):
        per_step = f" {1e3 * seconds / steps:7.3f} ms/step" if steps else ""
        print(f"  {seconds:8.3f}s {100 * seconds / max(busy, 1e-9):5.1f}% of busy{per_step}  {kind}")
    for name, count, us in rows[:top]:
        print(f"  {us / 1e6:8.3f}s {100 * us / 1e6 / wall:5.1f}% {count:8d}x {us / count:9.1f}us  {name[:90]}")


class ClockTrace:
    """The GPU's SM clock and power draw sampled by `nvidia-smi --loop-ms` while the timed run goes: does the
    device slow down (power or thermal limits) during the compute-bound prefill steps?"""
    FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"

    def __init__(self, period_ms: int = 10):
        import datetime
        import subprocess
        self._datetime = datetime
        self.samples: list[tuple[float, float, float, float, float]] = []  # (unix time, sm MHz, mem MHz, W, C)
        try:
            self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                           f"--loop-ms={period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          text=True)
        except OSError as e:
            print(f"clock trace: no nvidia-smi ({e})")
            self._proc = None

    def stop(self):
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                when = self._datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((when, *(float(v) for v in parts[1:5])))
            except (ValueError, IndexError):
                continue

    def report(self, segments: list[tuple[str, float, float]]):
        """Per (name, unix start, unix end): SM clock min / mean / max, power and temperature."""
        if self._proc is None:
            return
        print(f"clock trace: {len(self.samples)} samples")
        for name, begin, end in segments:
            inside = [s for s in self.samples if begin <= s[0] <= end]
            if not inside:
                print(f"  {name:>14}: no sample")
                continue
            sm, power, temp = [s[1] for s in inside], [s[3] for s in inside], [s[4] for s in inside]
            print(f"  {name:>14}: SM clock {min(sm):.0f} / {sum(sm) / len(sm):.0f} / {max(sm):.0f} MHz (min / mean / "
                  f"max), power {sum(power) / len(power):.0f} W (max {max(power):.0f}), {max(temp):.0f} C, "
                  f"{len(inside)} samples")
