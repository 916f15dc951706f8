"""Build tlm_io/data/eval_encyclopedic.txt, the encyclopedic evaluation set (provenance: tlm_io/data/README.md).

Offline and deterministic, from the Debian package ``stellarium-data`` (0.22.2-1): the English descriptions of
Stellarium's sky cultures (``skycultures/NAME/description.en.utf8``, HTML), which are reference prose on the
astronomy, history, mythology and ethnography of each culture, written by the culture's researchers. Only
cultures whose ``info.ini`` licence is free to copy and adapt are taken (CC BY-SA, GNU GPL, Free Art License; no
-NC or -ND terms); cultures in sorted name order. HTML is reduced to its text: headings and paragraphs become
paragraphs, images and their captions go, entities are decoded, list items and table rows become paragraphs of their own, and only prose is kept: paragraphs of at least
``MIN_CHARS`` characters that end a sentence, without bibliographic references, addresses or contributor lines.

    apt-get download stellarium-data && dpkg-deb -x stellarium-data_*.deb pkg
    python tools/build_eval_encyclopedic.py pkg/usr/share/stellarium/skycultures tlm_io/data/eval_encyclopedic.txt
"""

from __future__ import annotations

import configparser
import html
import re
import sys
from pathlib import Path

FREE = re.compile(r"CC BY-SA|GNU GPL|Free Art", re.I)
NOT_FREE = re.compile(r"-NC|-ND|\bNC\b|\bND\b")
MIN_CHARS = 80  # shorter paragraphs (labels, table rows, captions) are dropped
SENTENCE_END = re.compile(r"[.!?][\"')\u201d]?$")  # prose paragraphs end a sentence; table rows do not
NOT_PROSE = re.compile(r"ISBN|\(at\)|@|https?://|www\.|contributed to Stellarium|Press,|Retrieved|doi", re.I)


def licence(folder: Path) -> str:
    ini = configparser.ConfigParser(interpolation=None, strict=False)
    ini.read(folder / "info.ini", encoding="utf-8-sig")
    return ini.get("info", "license", fallback="").strip()


def is_free(text: str) -> bool:
    return bool(FREE.search(text)) and not NOT_FREE.search(text)


def html_paragraphs(source: str) -> list[str]:
    """The text of an HTML description, one entry per heading, paragraph, list item or table row."""
    source = re.sub(r"<(h5|figure|figcaption)\b.*?</\1>", " ", source, flags=re.S | re.I)  # image captions
    source = re.sub(r"<img\b[^>]*>", " ", source, flags=re.I)
    source = re.sub(r"</?(p|h[1-6]|li|tr|br|div|table|ul|ol|blockquote)\b[^>]*>", "\n\n", source, flags=re.I)
    source = re.sub(r"<[^>]+>", " ", source)  # inline tags
    text = html.unescape(source)
    out = []
    for block in re.split(r"\n\s*\n", text):
        block = re.sub(r"\s+", " ", block).strip()
        if len(block) >= MIN_CHARS and SENTENCE_END.search(block) and not NOT_PROSE.search(block):
            out.append(block)
    return out


def build(root: Path) -> tuple[str, list[tuple[str, str, int]]]:
    parts, used = [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        desc = folder / "description.en.utf8"
        terms = licence(folder)
        if not desc.is_file() or not is_free(terms):
            continue
        paragraphs = html_paragraphs(desc.read_text(encoding="utf-8"))
        if paragraphs:
            parts.append("\n\n".join(paragraphs))
            used.append((folder.name, terms, sum(map(len, paragraphs))))
    return "\n\n".join(parts) + "\n", used


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    text, used = build(root)
    out.write_text(text, encoding="utf-8")
    for name, terms, chars in used:
        print(f"{name}\t{chars}\t{terms}")
    print(f"{len(used)} cultures, {len(text)} characters -> {out}")


if __name__ == "__main__":
    main()
