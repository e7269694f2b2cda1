"""Moves a transcription's line tags after its .cu file changed: every
`# PREFIX:N` (or `N-M`) and `yield "PREFIXN"` in FILE.py that named a line
of OLD.cu is rewritten to name the same line in NEW.cu (matched with
difflib). Tags of lines that changed are mapped to the changed block's
lines in order and listed, to be read against the new source.
usage: python retag.py OLD.cu NEW.cu FILE.py PREFIX   (e.g. an old copy from
`git show HEAD:kernels/src/cuda/conv1d.cu`)"""
import difflib, re, sys

def line_map(old, new):
    m, changed = {}, set()
    sm = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        for i in range(i1, i2):
            if op == "equal":
                m[i + 1] = j1 + (i - i1) + 1
            elif j2 > j1:
                m[i + 1] = j1 + min(i - i1, j2 - j1 - 1) + 1
                changed.add(i + 1)
    return m, changed

def main(old_cu, new_cu, py, prefix):
    m, changed = line_map(open(old_cu).read().splitlines(), open(new_cu).read().splitlines())
    src = open(py).read()
    moved, doubt = 0, []

    def to(n):
        nonlocal moved
        n = int(n)
        if n in changed: doubt.append(n)
        k = m.get(n, n)
        moved += k != n
        return str(k)

    src = re.sub(rf"# {prefix}:(\d+)(?:-(\d+))?",
                 lambda g: f"# {prefix}:{to(g.group(1))}" + (f"-{to(g.group(2))}" if g.group(2) else ""),
                 src)
    src = re.sub(rf'yield "{prefix}(\d+)"', lambda g: f'yield "{prefix}{to(g.group(1))}"', src)
    open(py, "w").write(src)
    print(f"{py}: {moved} tags moved; tags on changed lines (read them): {sorted(set(doubt))}")

if __name__ == "__main__":
    main(*sys.argv[1:5])
