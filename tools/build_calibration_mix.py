"""Build tlm_io/data/calibration_mix.txt, the default calibration sample (provenance: tlm_io/data/README.md).

Offline, deterministic, from files of Debian packages installed on the build machine (Debian 12):

* the current prose sample, ``calibration_en.txt`` of the git history (Debian Administrator's Handbook + Factbook);
* C: the top-level headers of ``libc6-dev`` (GNU C Library 2.36, LGPL-2.1+), comments that carry a copyright or
  licence notice removed (the legal text would make the ``eval-legal`` set same-domain);
* Perl: modules of ``perl-modules-5.36`` (code and POD; same terms as Perl: Artistic-1.0 or GPL-1.0+), POD sections
  on copyright, licence and authors removed;
* the Vim user manual ``usr_*.txt`` of ``vim-runtime`` 9.0 (Open Publication License v1.0), its copyright section
  removed.

Each part contributes at most ``PER_FILE`` characters of each file, files in sorted path order, until its
character budget; paragraphs are kept whole. Run: ``python tools/build_calibration_mix.py PROSE_FILE OUT``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PER_FILE = 6000
BUDGETS = {"c": 170_000, "perl": 180_000, "vim": 170_000}  # characters (about 50k SmolLM2 tokens each)
NOTICE = re.compile(r"copyright|licen[cs]e|warranty|free software", re.I)


def package_files(package: str, pattern: str) -> list[Path]:
    listed = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True).stdout
    return sorted(Path(p) for p in listed.split() if re.fullmatch(pattern, p) and Path(p).is_file())


def strip_c(text: str) -> str:
    """C source without the comments that carry a licence or copyright notice."""
    return re.sub(r"/\*.*?\*/\n?", lambda m: "" if NOTICE.search(m.group(0)) else m.group(0), text, flags=re.S)


def strip_perl(text: str) -> str:
    """Perl without POD sections on copyright, licence or authors (up to the next =head1 or =cut) nor
    comment lines with a notice."""
    text = re.sub(r"^=head1\s+(COPYRIGHT|LICEN[CS]E|AUTHORS?|COPYRIGHT AND LICEN[CS]E)\b.*?(?=^=head1|^=cut|\Z)", "",
                  text, flags=re.S | re.M | re.I)
    return "\n".join(line for line in text.split("\n") if not (line.lstrip().startswith("#") and NOTICE.search(line)))


def strip_vim(text: str) -> str:
    """A Vim manual chapter without its copyright section and modeline footer."""
    text = re.sub(r"^\*01\.4\*\s+Copyright.*?(?=^\*01\.5\*|^=+\n|\Z)", "", text, flags=re.S | re.M)
    return "\n".join(line for line in text.split("\n") if not NOTICE.search(line))


def head(text: str, limit: int) -> str:
    """The first paragraphs of ``text`` up to ``limit`` characters (at least one paragraph)."""
    out, size = [], 0
    for para in re.split(r"\n\s*\n", text.strip()):
        if out and size + len(para) > limit:
            break
        out.append(para)
        size += len(para) + 2
    return "\n\n".join(out)


def part(files: list[Path], strip, budget: int) -> str:
    chunks, size = [], 0
    for path in files:
        chunk = head(strip(path.read_text(encoding="utf-8", errors="replace")), PER_FILE)
        if len(chunk) < 200:
            continue
        chunks.append(chunk)
        size += len(chunk) + 2
        if size >= budget:
            break
    return "\n\n".join(chunks)


def main(prose: str, out: str) -> None:
    parts = [
        Path(prose).read_text(encoding="utf-8").strip(),
        part(package_files("libc6-dev", r"/usr/include/[^/]+\.h"), strip_c, BUDGETS["c"]),
        part(package_files("perl-modules-5.36", r"/usr/share/perl/5\.36\.0/[^/]+(/[^/]+)?\.pm"), strip_perl,
             BUDGETS["perl"]),
        part(package_files("vim-runtime", r"/usr/share/vim/vim90/doc/usr_\d\d\.txt"), strip_vim, BUDGETS["vim"]),
    ]
    Path(out).write_text("\n\n".join(parts) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:3])
