"""Process helpers shared by ``bench_torch.py`` and ``bench_embed.py``: run a child with a
timeout and collect its own rusage, and count the machine's busy CPU time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# CPU seconds used by every process started through run_process (to tell our load from others').
children_cpu_s = 0.0


def busy_cpu_seconds():
    """CPU seconds spent busy on the whole machine since boot (all CPUs, from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_process(cmd, timeout_s, env=None, stdin_path=None):
    """Run cmd in the repository root; return (rc, stdout, stderr, ru_maxrss_mib, wall_s,
    timed_out). The child's own rusage comes from wait4; note that a child forked from a large
    Python process counts the pages it shared before exec in its ru_maxrss."""
    global children_cpu_s
    fin = open(stdin_path, "rb") if stdin_path else subprocess.DEVNULL
    try:
        with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, stdin=fin, stdout=fo, stderr=fe, env=env, cwd=REPO)
            timed_out = False
            while True:
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid == p.pid:
                    break
                if time.perf_counter() - t0 > timeout_s:
                    timed_out = True
                    os.kill(p.pid, signal.SIGKILL)
                    _, status, ru = os.wait4(p.pid, 0)
                    break
                time.sleep(0.01)
            wall = time.perf_counter() - t0
            p.returncode = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen quiet
            fo.seek(0)
            fe.seek(0)
            out = fo.read().decode(errors="replace")
            err = fe.read().decode(errors="replace")
    finally:
        if stdin_path:
            fin.close()
    children_cpu_s += ru.ru_utime + ru.ru_stime
    return p.returncode, out, err, ru.ru_maxrss / 1024.0, wall, timed_out


# Seconds to wait before starting multihead's process after PyTorch ran in this one.
SETTLE_S = 1.0


def settle():
    """Waits until PyTorch's OpenMP workers in this process stop spinning. After a parallel
    region they busy-wait for more work before they sleep; a child started at once shares the
    two cores with them (a bf16 encoder layer's eval measured 22.4-23.9 ms started at once,
    21.2-21.6 ms a second later; docs/performance.md, twelfth session). The sleep is outside
    every timed region and changes nothing for PyTorch's own timings."""
    time.sleep(SETTLE_S)


def timed(fn, warmup, iters):
    """Calls ``fn`` ``warmup`` times, then times ``iters`` calls; returns (min, median) ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, iters)):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[0], times[len(times) // 2]


def run_tool(script, threads, quick, json_out, timeout_s, extra=()):
    """Runs a section script (``tools/<script>``) in its own process with ``--threads``,
    ``--json-out`` and ``--quick``; returns its JSON, or ``{"error": ...}``."""
    tools = Path(__file__).resolve().parent
    cmd = [sys.executable, str(tools / script), "--threads", str(threads),
           "--json-out", str(json_out)] + (["--quick"] if quick else []) + list(extra)
    rc, _, err, _, _, timed_out = run_process(cmd, timeout_s)
    if rc != 0 or timed_out:
        why = "timed out" if timed_out else f"exit code {rc}"
        return {"error": f"{why}: {(err or '')[-2000:]}"}
    return json.loads(Path(json_out).read_text())


def finish(doc, json_out, report_lines, evaluate_targets):
    """A section script's end: writes ``doc`` to ``json_out``, prints its report and its
    targets."""
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(doc, indent=1))
    print("\n".join(report_lines(doc)))
    for t in evaluate_targets(doc):
        print(f"- {t['target']}, {t['case']}: {t['measured']} (required {t['required']}): "
              f"{t['verdict']}")

