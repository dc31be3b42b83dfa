#!/usr/bin/env python3
"""manifest.py - print a sorted, exact listing of a directory tree so two trees
can be compared with cmp/diff (used by bench/run.sh to verify restores).

One line per entry, path relative to the root:
    d MODE path                  directory
    f MODE SIZE SHA256 path      regular file
    l -> TARGET path             symlink (not followed)
    ? path                       anything else
Timestamps, owners and hardlink structure are not compared.

    manifest.py DIR > listing.txt
"""
import hashlib
import os
import stat
import sys


def main():
    root = sys.argv[1]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            mode = f"{stat.S_IMODE(st.st_mode):04o}"
            if stat.S_ISLNK(st.st_mode):
                out.append((rel, f"l -> {os.readlink(p)} {rel}"))
            elif stat.S_ISDIR(st.st_mode):
                out.append((rel, f"d {mode} {rel}"))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
                out.append((rel, f"f {mode} {st.st_size} {digest} {rel}"))
            else:
                out.append((rel, f"? {rel}"))
    out.sort()
    sys.stdout.write("".join(line + "\n" for _, line in out))


if __name__ == "__main__":
    main()
