"""Rebuild kjv.txt.xz from Debian's bible-kjv packages (see SOURCE.md for the full recipe).

Usage: python build_kjv.py /path/to/unpacked/debs  (writes kjv.txt.xz beside this script)

The `bible` program pretty-prints "Book N" chapter headings and "  V text" verse lines. We keep
the book name once, then one verse per line without numbers (numbers are noise to a language
model), and separate books by one blank line so a book can serve as a document.
"""

import lzma
import re
import subprocess
import sys
from pathlib import Path

HEADING = re.compile(r"^(\S.*) (\d+)$")  # "1 Samuel 3"
VERSE = re.compile(r"^ +\d+ (.*)$")  # "  16 For God so loved the world, ..."


def kjv_text(root: Path) -> str:
    """Print every verse with the package's own program and reshape it into plain text."""
    raw = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l", "1000000"]
        + ["Gen1:1-Rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    books: list[list[str]] = []
    for line in raw.splitlines():
        if heading := HEADING.match(line):
            if not books or books[-1][0] != heading.group(1):
                books.append([heading.group(1)])
        elif verse := VERSE.match(line):
            books[-1].append(" ".join(verse.group(1).split()))
        elif line.strip():
            raise ValueError(f"unexpected line from bible: {line!r}")
    return "\n\n".join("\n".join(book) for book in books) + "\n"


if __name__ == "__main__":
    text = kjv_text(Path(sys.argv[1]))
    out = Path(__file__).with_name("kjv.txt.xz")
    out.write_bytes(lzma.compress(text.encode("ascii"), preset=9 | lzma.PRESET_EXTREME))
    print(f"{out}: {len(text):,} chars, {text.count(chr(10) * 2) + 1} books")
