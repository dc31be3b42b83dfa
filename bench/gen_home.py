#!/usr/bin/env python3
"""gen_home.py - deterministic generator of a fake "agent home" directory for
roost benchmarks (see bench/run.sh).

The tree looks like a real developer/agent home: toolchain-like trees of many
small source-like text files (.cargo/registry, node_modules, .rustup), git
repos with incompressible pack files, a few files over 8 MiB (some compressible,
some not, some mixed), symlinks (relative, absolute, dangling), empty dirs, and
user notes/scripts.  Same arguments + same seed => byte-identical content.

    gen_home.py DEST [--files N] [--size 2G] [--seed S]   # create DEST
    gen_home.py DEST --mutate PERCENT [--seed S]          # mutate DEST in place

--mutate rewrites some bytes in / appends to about PERCENT% of the existing
regular files and adds a few new files (deterministic for a given tree + seed).

Python 3.11 standard library only.  Random bytes come from SHAKE-128 keyed by
(seed, file, block), which is fast (~400 MB/s) and deterministic.
"""
import argparse
import hashlib
import math
import os
import random
import sys
import time

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BLOCK = 64 * KiB  # generation/write granularity for large files

WORDS = ("alloc buf byte cache chunk config ctx data decode encode entry err "
         "file flag frame hash header index inner item iter key len list map "
         "meta mode name node offset opts path pool ptr queue reader ref repo "
         "request result root scope seed size slice state store stream sync "
         "table task token tree value vec view worker writer").split()
SYLLABLES = "ar ba co de el fa go hi in jo ka lu mo ne or pa qu ri so tu ur vi xo ze".split()


def parse_size(s: str) -> int:
    """'2G', '200M', '512k', '1000' -> bytes (binary units)."""
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


# ----------------------------------------------------------------------------
# content sources


def random_blocks(key: str, size: int):
    """Incompressible, deterministic bytes for `key`, yielded in BLOCK pieces."""
    i = 0
    while size > 0:
        n = min(BLOCK, size)
        yield hashlib.shake_128(f"{key}:{i}".encode()).digest(n)
        size -= n
        i += 1


def make_ident(rng: random.Random) -> str:
    if rng.random() < 0.6:
        return "_".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def build_corpus(rng: random.Random, kind: str, size: int) -> bytes:
    """About `size` bytes of source-like text; small files are slices of it."""
    idents = [make_ident(rng) for _ in range(3000)]
    types = [i.title().replace("_", "") for i in idents[:300]]
    I = lambda: rng.choice(idents)  # noqa: E731
    T = lambda: rng.choice(types)  # noqa: E731
    templates = {
        "rust": (
            lambda: f"pub fn {I()}(&self, {I()}: &{T()}) -> Result<{T()}> {{",
            lambda: f"    let {I()} = self.{I()}.{I()}({I()}, {rng.randint(0, 4096)})?;",
            lambda: f"    if {I()}.len() > {rng.randint(1, 999)} {{ return Err(Error::{T()}); }}",
            lambda: f"/// Returns the {I()} of the {I()} (see [`{T()}`]).",
            lambda: f"    {I()}: {rng.choice(('u64', 'usize', 'Vec<u8>', 'String', 'Option<Box<Node>>'))},",
            lambda: f"impl {T()} for {T()} {{",
            lambda: f"use crate::{I()}::{{{T()}, {I()}}};",
            lambda: "}", lambda: "", lambda: "    }",
        ),
        "js": (
            lambda: f"function {I()}({I()}, {I()}) {{",
            lambda: f"  const {I()} = require('{I()}/{I()}');",
            lambda: f"  if (!{I()}.{I()}) throw new TypeError('{I()} must be a {I()}');",
            lambda: f"  return {I()}.map(({I()}) => {I()}[{rng.randint(0, 64)}]);",
            lambda: f"module.exports.{I()} = {I()};",
            lambda: f"export interface {T()} {{ {I()}: string; {I()}?: number }}",
            lambda: f"// {' '.join(rng.choices(WORDS, k=rng.randint(3, 9)))}",
            lambda: "}", lambda: "", lambda: "  });",
        ),
        "prose": (
            lambda: " ".join(rng.choices(WORDS, k=rng.randint(4, 16))).capitalize() + ".",
            lambda: f"## {T()}",
            lambda: f"- `{I()}`: {' '.join(rng.choices(WORDS, k=rng.randint(4, 12)))}",
            lambda: f"<p>{' '.join(rng.choices(idents, k=rng.randint(4, 12)))}</p>",
            lambda: "",
        ),
    }[kind]
    out, n = [], 0
    while n < size:
        line = rng.choice(templates)()
        out.append(line)
        n += len(line) + 1
    return "\n".join(out).encode()


def text_blocks(rng: random.Random, kind: str, size: int):
    """Compressible but non-repeating text (logs / SQL dump) for big files."""
    bodies = [f"{rng.choice(('INFO', 'INFO', 'DEBUG', 'WARN'))} {rng.choice(WORDS)}::{rng.choice(WORDS)} "
              f"{' '.join(rng.choices(WORDS, k=rng.randint(2, 8)))} status={rng.choice((200, 200, 204, 404, 500))}"
              for _ in range(500)]
    t = 1_700_000_000 + rng.randint(0, 10**7)
    while size > 0:
        hx = rng.randbytes(8 * 4096).hex()
        picks = rng.choices(bodies, k=4096)
        if kind == "sql":
            lines = [f"INSERT INTO events VALUES ({t + j}, '{hx[16 * j:16 * j + 16]}', '{picks[j]}');"
                     for j in range(4096)]
        else:
            lines = [f"{t + j}.{j % 1000:03d} {picks[j]} took={j * 7 % 997}ms id={hx[16 * j:16 * j + 16]}"
                     for j in range(4096)]
        t += 4096
        b = ("\n".join(lines) + "\n").encode()[:size]
        size -= len(b)
        yield b


# ----------------------------------------------------------------------------
# the writer


class Home:
    def __init__(self, root: str, seed: int):
        self.root, self.seed = root, seed
        self.rng = random.Random(seed)
        self.made_dirs = set()
        self.files = self.bytes = self.links = 0
        self.used_names = set()
        self.corpus = {k: build_corpus(random.Random(f"{seed}:{k}"), k, 1 * MiB)
                       for k in ("rust", "js", "prose")}
        self.licenses = [build_corpus(random.Random(f"{seed}:lic{i}"), "prose", 1000 + 6000 * i)
                         for i in range(3)]

    def mkdir(self, rel: str):
        if rel and rel not in self.made_dirs:
            os.makedirs(os.path.join(self.root, rel), exist_ok=True)
            self.made_dirs.add(rel)

    def write(self, rel: str, data, mode: int = 0o644):
        """data: bytes or an iterable of bytes."""
        self.mkdir(os.path.dirname(rel))
        path = os.path.join(self.root, rel)
        with open(path, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
                self.bytes += len(data)
            else:
                for b in data:
                    f.write(b)
                    self.bytes += len(b)
        if mode != 0o644:
            os.chmod(path, mode)
        self.files += 1

    def symlink(self, target: str, rel: str):
        self.mkdir(os.path.dirname(rel))
        os.symlink(target, os.path.join(self.root, rel))
        self.links += 1

    def unique(self, base: str) -> str:
        """base, or base-2, base-3... if already used (package names must not collide)."""
        name, i = base, 1
        while name in self.used_names:
            i += 1
            name = f"{base}-{i}"
        self.used_names.add(name)
        return name

    def text(self, kind: str, size: int) -> bytes:
        c = self.corpus[kind]
        off = self.rng.randrange(0, len(c) - size)
        return c[off:off + size]

    def small_size(self) -> int:
        return int(math.exp(self.rng.uniform(math.log(200), math.log(20 * KiB))))

    def tree_files(self, base: str, n: int, exts, kind: str, min_depth=0, max_depth=4):
        """n text files under base, in a random directory tree of bounded depth."""
        dirs = [(base, 0)]
        for i in range(n):
            d, depth = self.rng.choice(dirs)
            if depth < max_depth and (depth < min_depth or self.rng.random() < 0.25):
                d, depth = f"{d}/{make_ident(self.rng)}", depth + 1
                dirs.append((d, depth))
            self.write(f"{d}/{make_ident(self.rng)}_{i}{self.rng.choice(exts)}", self.text(kind, self.small_size()))

    # --- areas ---------------------------------------------------------------

    def cargo(self, n: int):
        reg = ".cargo/registry/src/index.crates.io-6f17d22bba15001f"
        cache = ".cargo/registry/cache/index.crates.io-6f17d22bba15001f"
        while n > 0:
            crate = f"{make_ident(self.rng).replace('_', '-')}-{self.rng.randint(0, 3)}.{self.rng.randint(0, 40)}.{self.rng.randint(0, 20)}"
            k = min(n, self.rng.randint(8, 120))
            crate = self.unique(crate)
            base = f"{reg}/{crate}"
            self.write(f"{base}/Cargo.toml", self.text("prose", self.rng.randint(500, 3000)))
            self.write(f"{base}/LICENSE-MIT", self.licenses[0])       # identical across crates
            self.write(f"{base}/LICENSE-APACHE", self.licenses[2])
            self.write(f"{cache}/{crate}.crate", random_blocks(f"{self.seed}:{crate}", self.rng.randint(4 * KiB, 300 * KiB)))
            self.write(f"{base}/src/lib.rs", self.text("rust", self.small_size()))
            rest = k - 5
            if rest > 0:
                self.tree_files(f"{base}/src", rest * 3 // 4, [".rs"], "rust", 1, 3)
                self.tree_files(f"{base}/{self.rng.choice(('tests', 'examples', 'benches'))}",
                                rest - rest * 3 // 4, [".rs"], "rust", 0, 1)
            n -= max(k, 5)

    def node(self, n: int, projects):
        while n > 0:
            proj = self.rng.choice(projects)
            nm = f"projects/{proj}/node_modules"
            parent = nm
            for _ in range(self.rng.choice((0, 0, 0, 0, 1, 1, 2))):  # nested node_modules
                parent = f"{parent}/{make_ident(self.rng).replace('_', '-')}/node_modules"
            pkg = make_ident(self.rng).replace("_", "-")
            base = self.unique(f"{parent}/{pkg}")
            pkg = base.rsplit("/", 1)[1]
            k = min(n, self.rng.randint(4, 80))
            self.write(f"{base}/package.json", self.text("js", self.rng.randint(300, 2000)))
            self.write(f"{base}/LICENSE", self.licenses[1])
            self.write(f"{base}/README.md", self.text("prose", self.small_size()))
            self.write(f"{base}/bin/cli.js", b"#!/usr/bin/env node\n" + self.text("js", 400), 0o755)
            if parent == nm:
                self.symlink(f"../{pkg}/bin/cli.js", f"{nm}/.bin/{pkg}")
            if k > 4:
                self.tree_files(f"{base}/{self.rng.choice(('lib', 'dist', 'src', 'esm'))}", k - 4,
                                [".js", ".js", ".d.ts", ".mjs", ".map"], "js", 0, 3)
            n -= max(k, 4)

    def rustup(self, n: int):
        tc = ".rustup/toolchains/stable-x86_64-unknown-linux-gnu"
        self.symlink("stable-x86_64-unknown-linux-gnu", ".rustup/toolchains/stable")
        self.write(".rustup/settings.toml", b'version = "12"\ndefault_toolchain = "stable"\n')
        src = n * 2 // 3
        libs = ("core", "std", "alloc", "proc_macro", "test", "portable-simd", "stdarch", "backtrace")
        for i, lib in enumerate(libs):
            k = src // len(libs) + (1 if i < src % len(libs) else 0)
            self.tree_files(f"{tc}/lib/rustlib/src/rust/library/{lib}/src", k, [".rs"], "rust", 0, 1)
        self.tree_files(f"{tc}/share/doc/rust/html", n - src, [".html", ".js", ".css"], "prose", 1, 2)

    def misc(self, n: int, projects):
        for i, proj in enumerate(projects):
            g = f"projects/{proj}/.git"
            self.write(f"{g}/HEAD", b"ref: refs/heads/main\n")
            self.write(f"{g}/config", b"[core]\n\trepositoryformatversion = 0\n\tbare = false\n")
            self.write(f"{g}/refs/heads/main", hashlib.sha1(f"{self.seed}:{proj}".encode()).hexdigest().encode() + b"\n")
            self.write(f"{g}/hooks/pre-commit.sample", self.licenses[0], 0o755)  # identical across repos
            self.mkdir(f"{g}/refs/tags")                                           # empty dirs
            self.mkdir(f"projects/{proj}/target/debug/incremental")
            n -= 4
        for i in range(6):
            self.write(f"notes/{make_ident(self.rng)}.md", self.text("prose", self.small_size()))
            self.write(f"bin/{make_ident(self.rng)}.sh", b"#!/bin/sh\nset -eu\n" + self.text("prose", 600), 0o755)
            n -= 2
        self.write(".bashrc", self.text("prose", 3000))
        self.write(".gitconfig", b"[user]\n\tname = Agent\n\temail = agent@example.com\n")
        self.symlink("/usr/bin/python3", "bin/python")             # absolute
        self.symlink("../does/not/exist", ".config/dangling-link")  # dangling
        self.symlink(f"../projects/{projects[0]}", "notes/main-project")  # symlink to a dir
        for d in (".cache/empty", ".local/state", ".config/empty/nested"):
            self.mkdir(d)
        n -= 2
        per = max(1, n // (len(projects) + 2))
        for proj in projects:
            self.tree_files(f"projects/{proj}/src", min(per, max(n, 0)), [".rs", ".ts", ".py"], "rust", 1, 4)
            n -= per
        if n > 0:  # pip/http cache: small binary blobs, deep paths
            for i in range(n):
                h = hashlib.sha1(f"{self.seed}:pip{i}".encode()).hexdigest()
                self.write(f".cache/pip/http-v2/{h[0]}/{h[1]}/{h[2]}/{h[3]}/{h[4]}/{h}",
                           b"".join(random_blocks(f"{self.seed}:pip{i}", self.small_size())))

    def big(self, budget: int, projects) -> int:
        """Files of 9-40 MiB until budget is spent; returns bytes written."""
        spots = (
            (".rustup/toolchains/stable-x86_64-unknown-linux-gnu/lib/librustc_driver-{h}.so", "mixed"),
            (".cache/huggingface/hub/models--tiny/blobs/{h}", "random"),
            ("projects/{p}/data/dump-{i}.sql", "sql"),
            (".local/share/agent/logs/session-{i}.log", "log"),
            (".vscode-server/bin/{h}/node", "mixed"),
        )
        used, i = 0, 0
        while budget - used >= 9 * MiB:
            size = min(self.rng.randint(9 * MiB, 40 * MiB), budget - used)
            pattern, kind = spots[i % len(spots)]
            h = hashlib.sha1(f"{self.seed}:big{i}".encode()).hexdigest()
            rel = pattern.format(h=h[:16], p=self.rng.choice(projects), i=i)
            key = f"{self.seed}:big{i}"
            if kind == "random":
                data = random_blocks(key, size)
            elif kind in ("sql", "log"):
                data = text_blocks(random.Random(key), kind, size)
            else:  # mixed: alternating 1 MiB of random and text
                data = mixed_blocks(key, size)
            self.write(rel, data, 0o755 if rel.endswith("/node") else 0o644)
            used += size
            i += 1
        return used

    def packs(self, budget: int, projects) -> int:
        """git pack files of 1-50 MiB (incompressible) until budget is spent."""
        used, i = 0, 0
        while budget - used >= 1 * MiB:
            size = min(self.rng.randint(1 * MiB, 50 * MiB), budget - used)
            proj = projects[i % len(projects)]
            h = hashlib.sha1(f"{self.seed}:pack{i}".encode()).hexdigest()
            d = f"projects/{proj}/.git/objects/pack"
            self.write(f"{d}/pack-{h}.pack", random_blocks(f"{self.seed}:pack{i}", size), 0o444)
            self.write(f"{d}/pack-{h}.idx", b"".join(random_blocks(f"{self.seed}:idx{i}", size // 40 + 1024)), 0o444)
            used += size + size // 40 + 1024
            i += 1
        return used


def mixed_blocks(key: str, size: int):
    """Alternating runs of ~1 MiB random bytes and ~1 MiB log text (like a binary with data sections)."""
    rand = random_blocks(key, size)
    text = text_blocks(random.Random(key), "log", size)
    n = 0
    while n < size:
        b = next(rand if (n // MiB) % 2 == 0 else text)[: size - n]
        n += len(b)
        yield b


def generate(dest: str, n_files: int, total: int, seed: int):
    if os.path.exists(dest) and os.listdir(dest):
        sys.exit(f"gen_home: {dest} exists and is not empty")
    os.makedirs(dest, exist_ok=True)
    t0 = time.monotonic()
    home = Home(dest, seed)
    rng = home.rng
    projects = [make_ident(rng).replace("_", "-") for _ in range(max(2, min(8, n_files // 5000 + 2)))]
    n_packs_guess = 2 * max(2, total // (64 * MiB))  # .pack + .idx files, roughly
    small = max(0, n_files - 60 - n_packs_guess)
    home.cargo(small * 35 // 100)
    home.node(small * 35 // 100, projects)
    home.rustup(small * 15 // 100)
    home.misc(n_files - n_packs_guess - home.files, projects)
    small_bytes = home.bytes
    rest = total - small_bytes
    if rest < 0:
        print(f"gen_home: warning: small files alone take {human(small_bytes)} > --size", file=sys.stderr)
    big = home.big(max(0, rest) * 55 // 100, projects)
    home.packs(max(0, rest - big), projects)
    dt = time.monotonic() - t0
    print(f"gen_home: {dest}: {home.files} files, {home.links} symlinks, {len(home.made_dirs)} dirs, "
          f"{human(home.bytes)} (small files {human(small_bytes)}) in {dt:.1f}s "
          f"({home.bytes / MiB / max(dt, 1e-9):.0f} MiB/s)")


# ----------------------------------------------------------------------------
# mutation


def mutate(dest: str, percent: float, seed: int):
    t0 = time.monotonic()
    files = []
    for dirpath, dirnames, filenames in os.walk(dest):
        dirnames.sort()
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                files.append(p)
    rng = random.Random(f"mutate:{seed}:{percent}")
    k = min(len(files), max(1, round(len(files) * percent / 100)))
    chosen = rng.sample(files, k)
    changed = 0
    for i, p in enumerate(chosen):
        size = os.path.getsize(p)
        mode = os.stat(p).st_mode
        os.chmod(p, mode | 0o200)  # packs are read-only, like in real git
        with open(p, "r+b") as f:
            is_text = all(32 <= c < 127 or c in (9, 10, 13) for c in f.read(256))
            gen = (lambda n: "".join(rng.choice(WORDS) + " " for _ in range(n // 4 + 1)).encode()[:n]) \
                if is_text else (lambda n: rng.randbytes(n))
            action = rng.choice(("overwrite", "append", "both"))
            spots = 1 if size < MiB else rng.randint(1, 4)  # big files: a few scattered edits
            if action != "append" and size > 0:
                for _ in range(spots):
                    n = min(size, rng.randint(16, 4096))
                    f.seek(rng.randrange(0, size - n + 1))
                    f.write(gen(n))
            if action != "overwrite":
                f.seek(0, os.SEEK_END)
                f.write(gen(rng.randint(16, 4096)))
        os.chmod(p, mode)
        changed += 1
    new = max(3, k // 20)
    for j in range(new):
        d = os.path.dirname(chosen[j % len(chosen)])
        with open(os.path.join(d, f"new-{seed}-{j}.txt"), "wb") as f:
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 2000))).encode())
    print(f"gen_home: mutated {changed} of {len(files)} files ({percent}%), added {new} files "
          f"in {time.monotonic() - t0:.1f}s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest")
    ap.add_argument("--files", type=int, default=100_000, help="approximate number of regular files")
    ap.add_argument("--size", type=parse_size, default=parse_size("2G"), help="approximate total bytes (2G, 200M)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mutate", type=float, metavar="PERCENT", help="mutate an existing tree instead")
    a = ap.parse_args()
    if a.mutate is not None:
        mutate(a.dest, a.mutate, a.seed)
    else:
        generate(a.dest, a.files, a.size, a.seed)


if __name__ == "__main__":
    main()
