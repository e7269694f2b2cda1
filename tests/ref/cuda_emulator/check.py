"""Runs every check of the emulator, and fails if a check fails, the simt
tracker reports an issue (each script ends with its report: "no issues"
when clean), or a CUDA source changed since its transcriptions were last
checked against it.

The transcriptions are hand-written: a kernel changed without its
transcription would leave the checks passing while saying nothing about
the new code. `pins.txt` holds each source's SHA-256 as of the last time
its transcriptions were brought up to date and checked. After changing a
source: change its transcription (`retag.py` moves the line tags), run
`check.py`, then `check.py --pin` to record the new hashes.

usage: python check.py            (CI runs this)
       python check.py --pin      (after the checks pass: record the sources' hashes)"""
import hashlib, os, re, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA = os.path.join(HERE, "..", "..", "..", "kernels", "src", "cuda")
PINS = os.path.join(HERE, "pins.txt")

# Every CUDA source and the transcriptions that follow it.
SOURCES = {
    "prelude.cuh": ["prelude.py"],
    "gated_delta.cu": ["kernels.py", "recurrent.py", "host.py"],
    "attention.cu": ["attention_kernels.py", "attention.py"],
    "conv1d.cu": ["conv1d.py"],
    "matmul.cu": ["matmul.py"],
    "activation.cu": ["elementwise.py"],
    "rope.cu": ["elementwise.py"],
    "embedding.cu": ["elementwise.py"],
    "optim.cu": ["elementwise.py"],
    "norm.cu": ["rows.py"],
    "logsoftmax.cu": ["rows.py"],
}

# The check runs: every case of each script (host.py: the small and the odd
# shapes, with and without an initial state).
RUNS = [
    ["host.py", "small"],
    ["host.py", "odd"],
    ["recurrent.py"],
    ["conv1d.py"],
    ["matmul.py"],
    ["elementwise.py"],
    ["rows.py"],
    ["attention.py"],
]

def sha(name):
    with open(os.path.join(CUDA, name), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()

def sources_on_disk():
    return sorted(n for n in os.listdir(CUDA) if n.endswith((".cu", ".cuh")))

def read_pins():
    if not os.path.exists(PINS): return {}
    pins = {}
    for line in open(PINS):
        if line.strip() and not line.startswith("#"):
            h, n = line.split()
            pins[n] = h
    return pins

def stale_sources():
    """What the sources say against the pins: a list of complaints."""
    out, pins = [], read_pins()
    for n in sources_on_disk():
        if n not in SOURCES:
            out.append(f"{n}: a CUDA source with no transcription (add one, and list it in SOURCES)")
        elif pins.get(n) != sha(n):
            out.append(f"{n} changed since {', '.join(SOURCES[n])} were last checked against it: "
                       "bring them up to date (retag.py moves the line tags), run check.py, "
                       "then check.py --pin")
    for n in SOURCES:
        if not os.path.exists(os.path.join(CUDA, n)):
            out.append(f"{n} is listed in SOURCES but is not in kernels/src/cuda")
    return out

def run_all():
    failed = []
    for cmd in RUNS:
        t0 = time.time()
        p = subprocess.run([sys.executable, *cmd], cwd=HERE, capture_output=True, text=True)
        lines = p.stdout.splitlines()
        bugs = [l for l in lines if re.search(r"BUG\??$", l.rstrip())]
        clean = any(l.rstrip().endswith("no issues") for l in lines)
        ok = p.returncode == 0 and not bugs and clean
        print(f"{' '.join(cmd)}: {'ok' if ok else 'FAILED'} ({len(lines)} lines, {time.time() - t0:.0f} s)",
              flush=True)
        if not ok:
            failed.append(" ".join(cmd))
            for l in bugs[:10]: print("  " + l)
            if not clean and p.returncode == 0:
                print("  the tracker reported issues:\n" + "\n".join(lines[-30:]))
            if p.returncode:
                print("  exit status", p.returncode, "\n" + p.stderr[-3000:])
    return failed

if __name__ == "__main__":
    pin = sys.argv[1:] == ["--pin"]
    stale = [] if pin else stale_sources()
    failed = run_all()
    for s in stale: print("STALE:", s)
    if failed or stale:
        print(f"emulator check failed: {len(failed)} runs failed, {len(stale)} sources unpinned")
        sys.exit(1)
    if pin:
        with open(PINS, "w") as f:
            f.write("# SHA-256 of each CUDA source as of the last check of its transcriptions"
                    " (check.py --pin)\n")
            for n in sources_on_disk():
                if n in SOURCES: f.write(f"{sha(n)}  {n}\n")
        print(f"pinned {len(SOURCES)} sources in pins.txt")
    else:
        print(f"emulator check: {len(RUNS)} runs clean, every source pinned")
