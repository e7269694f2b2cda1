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
    "gated_delta.cu": ["kernels.py", "recurrent.py", "sequential.py", "host.py"],
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
# shapes, with and without an initial state; sequential.py: its default
# groups).
RUNS = [
    ["host.py", "small"],
    ["host.py", "odd"],
    ["recurrent.py"],
    ["sequential.py"],
    ["conv1d.py"],
    ["matmul.py"],
    ["elementwise.py"],
    ["rows.py"],
    ["attention.py"],
]

# The CUDA sources each transcription's tags name (`# PREFIX:NNN`, and
# `yield "PREFIXNNN"` for a __syncthreads()).
TAGS = {
    "kernels.py": {"cu": "gated_delta.cu"},
    "recurrent.py": {"cu": "gated_delta.cu"},
    "sequential.py": {"cu": "gated_delta.cu"},
    "attention_kernels.py": {"cu": "attention.cu", "p": "prelude.cuh"},
    "conv1d.py": {"cu": "conv1d.cu"},
    "matmul.py": {"cu": "matmul.cu"},
    "prelude.py": {"p": "prelude.cuh"},
    "elementwise.py": {"act": "activation.cu", "rope": "rope.cu", "emb": "embedding.cu",
                       "opt": "optim.cu"},
    "rows.py": {"norm": "norm.cu", "ls": "logsoftmax.cu"},
}
# Python's names for CUDA's, and words only Python has.
SYNONYMS = {"tid": "threadIdx", "tx": "threadIdx", "ty": "threadIdx", "bx": "blockIdx",
            "bdim": "blockDim", "gdim": "gridDim", "uu": "u"}
PYTHON_ONLY = set("F D yield if else elif for in range while return and or not None True False "
                  "def int float min max abs len lambda".split())

def names(code, python):
    out = set()
    for w in re.findall(r"[A-Za-z_]\w*|0x[0-9a-fA-F]+", code):
        if w.startswith("0x"):
            out.add(w.lower().rstrip("u"))
        elif python:
            if w not in PYTHON_ONLY: out |= {w.rstrip("_"), SYNONYMS.get(w, w)}
        else:
            out.add(w)
    return out

def stale_tags():
    """A tag that names no line of its source, a barrier tag on a line with
    no __syncthreads(), or a statement sharing no name with the line its tag
    names: a transcription out of step with its source (a heuristic: it
    catches a tag moved by an edit, not a wrong operator)."""
    out = []
    for py, prefixes in TAGS.items():
        src = {k: open(os.path.join(CUDA, v)).read().splitlines() for k, v in prefixes.items()}
        for n, line in enumerate(open(os.path.join(HERE, py)).read().splitlines(), 1):
            for m in re.finditer(r'yield "([a-z]+)(\d+)"', line):
                k, no = m.group(1), int(m.group(2))
                if k in src and "__syncthreads" not in (src[k][no - 1] if no <= len(src[k]) else ""):
                    out.append(f"{py}:{n}: the barrier {k}{no} names a line with no __syncthreads()")
            m = re.search(r"#\s*([a-z]+):(\d+)(?:-(\d+))?", line)
            if not m or m.group(1) not in src:
                continue
            k, a = m.group(1), int(m.group(2))
            b = int(m.group(3) or a)
            if a < 1 or b > len(src[k]):
                out.append(f"{py}:{n}: {k}:{a} is past the end of {prefixes[k]}")
                continue
            mine = names(line[:m.start()], True)
            if mine and not mine & names(" ".join(src[k][a - 1:b]), False):
                out.append(f"{py}:{n}: {line.strip()!r} shares no name with {prefixes[k]}:{a}")
    return out

def stale_plants():
    """plant.py's planted bugs whose text is no longer in the transcription
    they change (run by hand, they would fail; left alone, they rot)."""
    import plant
    out = []
    for name, (f, reps, _) in plant.BUGS.items():
        src = open(os.path.join(HERE, f)).read()
        for rep in reps:
            old, rx = rep[0], len(rep) == 3 and rep[2]
            if not (re.search(old, src) if rx else old in src):
                out.append(f"plant.py {name}: {old.strip()!r} is no longer in {f}")
    return out

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
    stale = ([] if pin else stale_sources()) + stale_tags() + stale_plants()
    failed = run_all()
    for s in stale: print("STALE:", s)
    if failed or stale:
        print(f"emulator check failed: {len(failed)} runs failed, {len(stale)} stale sources, tags or plants")
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
