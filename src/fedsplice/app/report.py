"""`fedsplice report DIR`: one self-contained HTML page for a run, a comparison or a results
suite: its tables, and its PNG plots embedded as data URIs, so the file opens in a browser
from disk, without a server, and can be mailed as it is. `--screenshot PNG` renders the page
with headless Chromium, the check that it really displays.
"""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from markdown_it import MarkdownIt

from fedsplice.app.rundir import atomic_write_text
from fedsplice.errors import ConfigError

CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #bbb;padding:3px 7px;
text-align:left}th{background:#eee}td.n{text-align:right;white-space:nowrap}
img{max-width:100%;border:1px solid #ddd;margin:.5em .5em 0 0}figure{display:inline-block;margin:0}
figcaption{font-size:12px;color:#555}pre{background:#f6f6f6;padding:.7em;overflow:auto;font-size:12px}"""


NUM = re.compile(r"^[-−+]?[\d.,]+( ± [\d.,]+)?$|^—$|^n/a$")  # table cells set right-aligned


def _markdown() -> MarkdownIt:
    """CommonMark with pipe tables (markdown-it-py; raw HTML is escaped), rendered compactly:
    one line per top-level block, tables without thead/tbody, **b** and *i*, links as their
    text (their targets are local files), headings at most h4, numeric cells right-aligned,
    and images embedded as data URIs."""
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    rules = {"strong_open": "<b>", "strong_close": "</b>", "em_open": "<i>", "em_close": "</i>",
             "link_open": "", "link_close": "", "thead_open": "", "thead_close": "",
             "tbody_open": "", "tbody_close": "", "th_open": "<th>", "figures_open": "",
             "figures_close": "\n"}
    for name, text in rules.items():
        md.add_render_rule(name, lambda self, tokens, idx, options, env, _t=text: _t)
    md.add_render_rule("td_open", _td_open)
    md.add_render_rule("image", _image)
    return md


def _td_open(self, tokens, idx, options, env) -> str:
    cell = tokens[idx + 1].content.strip() if tokens[idx + 1].type == "inline" else ""
    return '<td class="n">' if NUM.match(cell) else "<td>"


def _image(self, tokens, idx, options, env) -> str:
    base = env.get("base")
    if base is None:
        return ""  # a folder's PNGs are embedded by the caller
    src = tokens[idx].attrGet("src")
    if not (base / src).is_file():
        raise ConfigError(f"report: the page shows {src}, which is not in {base}")
    return _img(base / src)


def _compact(tokens) -> None:
    """Only top-level blocks end a line; a paragraph of nothing but images becomes figures."""
    for i, t in enumerate(tokens):
        if t.type in ("heading_open", "heading_close"):
            t.tag = f"h{min(int(t.tag[1]), 4)}"
        if t.type == "paragraph_open" and not t.hidden and _only_images(tokens[i + 1]):
            t.type, tokens[i + 2].type = "figures_open", "figures_close"
        t.block = t.block and t.level == 0 and t.nesting != 1


def _only_images(inline) -> bool:
    kids = inline.children or []
    return any(k.type == "image" for k in kids) and all(
        k.type in ("image", "softbreak") or (k.type == "text" and not k.content.strip()) for k in kids)


_MD = _markdown()


def md_to_html(text: str, base: Path | None = None) -> str:
    """Markdown (CommonMark + pipe tables, by markdown-it-py) to HTML; with `base` (the folder
    image paths are relative to), images are embedded as data URIs."""
    env = {"base": base}
    tokens = _MD.parse(text, env)
    _compact(tokens)
    return _MD.renderer.render(tokens, _MD.options, env).rstrip("\n")


def _img(png: Path) -> str:
    data = base64.b64encode(png.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(png.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(png.name)}</figcaption></figure>")


def _num(v, spec: str = ".4f") -> str:
    """A metric cell; an undefined one (null in the JSON, or NaN) is "n/a"."""
    return "n/a" if v is None or v != v else format(v, spec)


def _section(d: Path, title: str) -> str:
    """A comparison folder (table.md + plots) or a run folder (results.json + metrics.jsonl)."""
    parts = [f"<h2>{html.escape(title)}</h2>"]
    if (d / "table.md").is_file():
        parts.append(md_to_html((d / "table.md").read_text()))
    elif (d / "results.json").is_file():
        r = json.loads((d / "results.json").read_text())
        c = r["communication"]
        rows = ["| | accuracy | F1 macro | balancedness |", "|---|---|---|---|"]
        refs = r.get("references") or {}
        for label, m in (("GM", r["gm"]), ("majority class (reference)", refs.get("majority", {}).get("gm")),
                         ("PM", r["pm"]), ("local prior (reference)", refs.get("local_prior", {}).get("pm"))):
            if m is None:
                continue
            beta = _num(m["balancedness"]) if "balancedness" in m else "—"
            rows.append(f"| {label} | {_num(m.get('accuracy'))} | {_num(m.get('f1_macro'))} | {beta} |")
        parts.append(f"<p>{html.escape(r['algorithm'])} on {html.escape(r['dataset'])} with "
                     f"{html.escape(r['model'])}, {r['rounds']} rounds, seed {r['seed']}; upload "
                     f"{c['up_bytes']:,} B in total, {c['up_bytes_per_round']:,.0f} B per round.</p>")
        parts.append(md_to_html("\n".join(rows)))
        parts += [f"<p><strong>{html.escape(w)}</strong></p>" for w in r.get("warnings", [])]
        if r.get("random_weights"):
            parts.append(f"<p><strong>RANDOM WEIGHTS ({html.escape(', '.join(r['random_weights']))}): "
                         f"these numbers test the code path, not the method.</strong></p>")
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] \
            if (d / "metrics.jsonl").is_file() else []
        ev = [x for x in recs if "gm" in x and "phase" not in x]
        if ev:
            t = ["| round | GM acc | PM acc | up bytes |", "|---|---|---|---|"]
            t += [f"| {x['round']} | {_num(x['gm'].get('accuracy'))} | {_num(x['pm'].get('accuracy'))} | "
                  f"{x.get('up_bytes', 0):,} |" for x in ev]
            parts.append(md_to_html("\n".join(t)))
        if (d / "config.toml").is_file():
            parts.append(f"<details><summary>config.toml</summary><pre>"
                         f"{html.escape((d / 'config.toml').read_text())}</pre></details>")
    parts += [_img(p) for p in sorted(d.glob("*.png"))]
    return "\n".join(parts)


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>fedsplice report: "
            f"{html.escape(title)}</title><style>{CSS}</style></head><body>\n{body}</body></html>\n")


def render(d: Path) -> str:
    d = Path(d)
    if d.is_file() and d.suffix == ".md":  # a results page (docs/results.md) and the plots it shows
        return _page(d.stem, md_to_html(d.read_text(), base=d.parent))
    if not d.is_dir():
        raise ConfigError(f"report: {d} is neither a folder nor a .md page; give a run, compare or "
                          f"results folder, or docs/results.md")
    own = (d / "table.md").is_file() or (d / "results.json").is_file()
    subs = sorted(p for p in d.iterdir() if p.is_dir() and (p / "table.md").is_file())
    if not own and not subs:
        raise ConfigError(f"report: {d} holds no results.json or table.md (nor a folder with one); "
                          f"give the --out of `fedsplice run` or `fedsplice compare`")
    body = [f"<h1>fedsplice report: {html.escape(d.name)}</h1>"]
    if own:
        body.append(_section(d, d.name))
    body += [_section(p, p.name) for p in subs]
    return _page(d.name, "\n".join(body))


def write_report(d: Path, out: Path | None = None) -> Path:
    d = Path(d)
    out = Path(out) if out else (d.with_suffix(".html") if d.suffix == ".md" else d / "report.html")
    atomic_write_text(out, render(d))
    return out


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    raise ConfigError("--screenshot: no Chromium found (chromium, chromium-browser, google-chrome); "
                      "install Debian's chromium (apt-get install chromium) or leave out --screenshot")


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 2400, timeout: float = 120) -> Path:
    """Render `page` with headless Chromium into `png` (no network: the page is self-contained)."""
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedsplice-chromium-") as profile:
        tmp = png.with_name(png.name + ".tmp.png")
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={width},{height}",
               f"--screenshot={tmp}", Path(page).resolve().as_uri()]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"--screenshot: Chromium did not finish within {timeout:.0f} s") from None
        if p.returncode != 0 or not tmp.is_file():
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"--screenshot: Chromium failed (exit {p.returncode}): {tail}")
        tmp.replace(png)
    return png


def ink(png: Path) -> float:
    """Share of pixels that are not near-white: a blank (failed) render gives about 0."""
    import matplotlib.image as mpimg
    import numpy as np

    a = mpimg.imread(png)[..., :3]
    return float(np.mean(a.min(axis=-1) < 0.9))
