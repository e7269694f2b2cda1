# Sanity of the emulator: apply one mutation to kernels.py (in mut/), run the small case.
import os, shutil, subprocess, sys
muts = {
  "no_barrier_270": ('        yield "cu270"\n', ''),
  "no_barrier_465": ('    yield "cu465"\n', ''),
  "transposed_KKE_474": ('r -= bet[l] * Kn[l * GD_CHUNK + i]', 'r -= bet[l] * Kn[i * GD_CHUNK + l]'),
  "solve_from_c-1_471": ('for i in range(c - 2, -1, -1):  # cu:471', 'for i in range(c - 1, -1, -1):  # cu:471'),
  "no_live_257": ('while i < c and live:  # cu:257', 'while i < c:  # cu:257'),
}
name = sys.argv[1]
src = open("kernels.py").read()
a, b = muts[name]
assert src.count(a) == 1, (name, src.count(a))
os.makedirs("mut", exist_ok=True)
open("mut/kernels.py", "w").write(src.replace(a, b))
for f in ("simt.py", "host.py"):
    shutil.copy(f, "mut/" + f)
r = subprocess.run([sys.executable, "-c", "import host; host.run((2, 4, 20, 12), [0, 70, 71, 71, 100], True)"],
                   cwd="mut", capture_output=True, text=True)
print("#", name); print(r.stdout[-3000:]); print(r.stderr[-1500:])
