"""The rollout viewer: one self-contained HTML page (inline CSS and JS, no network) from a run's
completions.jsonl and metrics.jsonl, to look at what was trained, token by token.

    python scripts/view_rollouts.py runs/latest                    # writes runs/latest/rollouts.html
    python scripts/view_rollouts.py runs/latest --out /tmp/r.html --last 0   # every logged step

Per logged step and group (the trainer logs, every --log-completions-every steps, the best- and the
worst-rewarded completion of two groups), each completion as a conversation. Its tokens are shaded by
what the loss did with them:
  trained   the model generated it (loss mask 1);
  tool      a tool result's text inside the suffix appended after a tool call (mask 0);
  template  the rest of that suffix: turn closer, role headers, <tool_response> tags (mask 0).
The trainer tells the last two apart when it writes the row (metrics.tool_output_kinds: the
template inserts each tool result verbatim, so the result's text is found in the rendered suffix).
A toggle colours trained tokens by |Δ logprob| (trainer π_old vs vLLM's behaviour μ) or by the loss's IS
weight min(π_old/μ, C); hovering a token shows its id, text and numbers. Tool calls and outputs fold
(<details>); filters by reward, stop reason and tool use. At the top: reward, accuracy and tool use over
steps from metrics.jsonl (inline SVG). The last 20 logged steps by default (`--last`): a row holds up to
4096 tokens and each becomes an element, so a long run's every step would make a page too big to open.

Model output is hostile: every piece of text is HTML-escaped, and the page's Content-Security-Policy
allows only its own script (by hash) and no network at all.
"""

import argparse
import base64
import hashlib
import html
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_metrics import load as load_metrics  # noqa: E402
from plot_metrics import read_jsonl  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("run_dir", help="a training run's --output-dir (holds completions.jsonl)")
parser.add_argument("--out", default=None, help="HTML file to write (default: RUN_DIR/rollouts.html)")
parser.add_argument("--last", type=int, default=20, help="only the last N logged steps (0 = all)")

# Colour buckets: |Δ logprob| edges (nats) and IS-weight edges; class d0..d5 / w0..w5.
DELTA_EDGES = (0.01, 0.05, 0.2, 0.5, 1.0)
WEIGHT_EDGES = (0.5, 0.8, 0.95, 1.05, 1.25)
KIND_CLASS = {"m": "gen", "t": "tool", "c": "tmpl"}


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def bucket(x: float, edges: tuple[float, ...]) -> int:
    return sum(x >= e for e in edges)


def load_rows(path: Path) -> tuple[list[dict], int]:
    """Rows of completions.jsonl and the number of lines that were not JSON rows. A resumed run writes
    the steps after its checkpoint again: each step's rows are those of the last process that wrote it
    (their `writer`), as load_metrics keeps a step's last metrics line."""
    rows, bad = read_jsonl(path)
    last = {r["step"]: r.get("writer") for r in rows}
    return [r for r in rows if r.get("writer") == last[r["step"]]], bad


def fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


# ---------------------------------------------------------------------------------------------------
# TOKENS → spans
# ---------------------------------------------------------------------------------------------------
def token_span(tok: dict, k: int) -> str:
    """One token as a span: kind class (gen/tool/tmpl), colour buckets, the numbers for hover."""
    kind = KIND_CLASS.get(tok["kind"][k] if k < len(tok["kind"]) else "c", "tmpl")
    mu, pi, w = tok["behaviour_logprob"][k], tok["trainer_logprob"][k], tok["is_weight"][k]
    cls, data = ["tk", kind], [f'data-id="{esc(tok["ids"][k])}"']
    if pi is not None:
        data.append(f'data-p="{pi}"')
    if kind == "gen" and mu is not None:
        data.append(f'data-b="{mu}"')
        if pi is not None:
            cls.append(f"d{bucket(abs(pi - mu), DELTA_EDGES)}")
    if kind == "gen" and w is not None:
        data.append(f'data-w="{w}"')
        cls.append(f"w{bucket(w, WEIGHT_EDGES)}")
    return f'<span class="{" ".join(cls)}" {" ".join(data)}>{esc(tok["pieces"][k])}</span>'


def spans(tok: dict, start: int, end: int) -> str:
    end = min(end, len(tok["ids"]))
    return "".join(token_span(tok, k) for k in range(start, end))


def call_start(tok: dict, start: int, end: int) -> int:
    """First token of the turn's tool call: the one holding "<tool_call>" (hermes), else the turn's
    first (Llama 3.1's call is the whole turn)."""
    text, k = "", start
    for k in range(start, min(end, len(tok["pieces"]))):
        text += tok["pieces"][k]
        if "<tool_call>" in text:
            return k
    return start


def render_completion(row: dict) -> str:
    calls = row.get("tool_calls") or []
    failed = sum(bool(c.get("failed")) for c in calls)
    tok = row.get("tokens")
    attrs = (
        f'data-reward="{esc(fmt(row.get("reward")))}" data-stop="{esc(row.get("stop_reason"))}" '
        f'data-tools="{len(calls)}" data-failed="{failed}"'
    )
    facts = [
        f"reward <b>{esc(fmt(row.get('reward')))}</b>",
        f"advantage {esc(fmt(row.get('advantage'), '+.2f'))}",
        f"stop <b>{esc(row.get('stop_reason'))}</b>",
        f"{len(calls)} tool call{'s' * (len(calls) != 1)}" + (f" ({failed} failed)" if failed else ""),
    ]
    if "model_versions" in row:
        facts.append(f"model versions {esc('–'.join(map(str, row['model_versions'])))}")
    if row.get("staleness") is not None:
        facts.append(f"staleness {esc(row['staleness'])}")
    if not tok:  # a row from before the token arrays: its text only
        body = f'<pre class="text">{esc(row.get("text", ""))}</pre>'
        return f'<section class="completion" {attrs}><header>{" · ".join(facts)}</header>{body}</section>'
    mask = tok["mask"]
    deltas = [
        abs(p - b)
        for p, b, m in zip(tok["trainer_logprob"], tok["behaviour_logprob"], mask)
        if m and p is not None and b is not None
    ]
    facts.append(f"{len(mask)} tokens ({sum(mask)} trained)")
    if deltas:
        facts.append(f"max |Δ logprob| {max(deltas):.3f}")
    if row.get("tokens_dropped"):
        facts.append(f"{esc(row['tokens_dropped'])} more tokens not logged")
    turns = []
    for t_index, turn in enumerate(row.get("turns") or []):
        a, g, n = turn["start"], turn["generated"], turn["appended"]
        versions = "–".join(map(str, turn.get("model_versions", [])))
        head = (
            f"assistant · turn {t_index + 1} · model versions {esc(versions)} · finish "
            f"{esc(turn.get('finish_reason'))} · {turn.get('generation_s', 0):.2f} s"
        )
        turn_calls = [c for c in calls if c.get("turn") == t_index]
        gen = spans(tok, a, a + g)
        if turn_calls:
            k = call_start(tok, a, a + g)
            names = ", ".join(
                f"{esc(c.get('name') or '?')} ({c.get('duration_s', 0):.2f} s, "
                f"{'failed' if c.get('failed') else 'ok'})"
                for c in turn_calls
            )
            gen = (
                spans(tok, a, k) + f'<details class="call"><summary>tool call: {names}</summary>'
                f'<div class="toks">{spans(tok, k, a + g)}</div></details>'
            )
        parts = [f'<div class="msg assistant"><div class="role">{head}</div><div class="toks">{gen}</div>']
        parts[0] += "</div>"
        if n:
            preview = " | ".join(c.get("result", "")[:80] for c in turn_calls).replace("\n", "⏎")
            parts.append(
                f'<details class="output"><summary>tool output · {n} tokens appended · '
                f"{turn.get('tool_s', 0):.2f} s: <code>{esc(preview)}</code></summary>"
                f'<div class="msg tool"><div class="toks">{spans(tok, a + g, a + g + n)}</div>'
                "</div></details>"
            )
        turns.append(
            f'<div class="turn" data-turn="{t_index + 1}" data-v="{esc(versions)}">{"".join(parts)}</div>'
        )
    return (
        f'<section class="completion" {attrs}><header>#{esc(row.get("completion_index", "?"))} · '
        f"{' · '.join(facts)}</header>{''.join(turns)}</section>"
    )


def render_group(rows: list[dict]) -> str:
    first = rows[0]
    prompt = "".join(
        f'<div class="msg {esc(m.get("role"))}"><div class="role">{esc(m.get("role"))}</div>'
        f'<div class="toks">{esc(m.get("content"))}</div></div>'
        for m in first.get("prompt_messages") or []
    )
    if prompt:
        n = esc(first.get("prompt_tokens", "?"))
        prompt = f"<details><summary>prompt ({n} tokens)</summary>{prompt}</details>"
    return (
        f'<section class="group"><h3>row {esc(first.get("row_index"))} · admitted at version '
        f"{esc(first.get('admitted_version'))} · answer <code>{esc(first.get('answer'))}</code></h3>"
        f'<p class="question">{esc(first.get("question"))}</p>{prompt}'
        + "".join(render_completion(r) for r in rows)
        + "</section>"
    )


# ---------------------------------------------------------------------------------------------------
# SUMMARY: inline SVG line charts from metrics.jsonl
# ---------------------------------------------------------------------------------------------------
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def svg_chart(title: str, series: dict[str, list[tuple[int, float]]], w: int = 300, h: int = 110) -> str:
    pts = [p for s in series.values() for p in s]
    if not pts:
        return ""
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(0.0, min(p[1] for p in pts)), max(1.0, max(p[1] for p in pts))
    sx = lambda x: 30 + (x - x0) / max(x1 - x0, 1) * (w - 40)  # noqa: E731
    sy = lambda y: h - 20 - (y - y0) / max(y1 - y0, 1e-9) * (h - 35)  # noqa: E731
    out = [f'<svg class="chart" width="{w}" height="{h}" viewBox="0 0 {w} {h}"><title>{esc(title)}</title>']
    out.append(f'<text x="4" y="12" class="ct">{esc(title)}</text>')
    out.append(f'<text x="2" y="{sy(y1) + 4:.0f}" class="ax">{y1:g}</text>')
    out.append(f'<text x="2" y="{sy(y0) + 4:.0f}" class="ax">{y0:g}</text>')
    out.append(f'<text x="30" y="{h - 4}" class="ax">step {x0}</text>')
    out.append(f'<text x="{w - 10}" y="{h - 4}" class="ax" text-anchor="end">{x1}</text>')
    out.append(f'<line x1="30" y1="{sy(y0):.1f}" x2="{w - 10}" y2="{sy(y0):.1f}" class="axis"/>')
    for i, (label, s) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        xy = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        out.append(f'<polyline points="{xy}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{colour}"/>' for x, y in s]
        # The label in its line's colour, after a swatch of the line (no CSS fill on .lg: a rule would
        # beat the fill attribute and grey every label alike).
        out.append(
            f'<text x="{w - 10}" y="{24 + 11 * i}" class="lg" fill="{colour}" text-anchor="end">'
            f'<tspan class="sw">\u2014 </tspan>{esc(label)}</text>'
        )
    return "".join(out) + "</svg>"


def render_summary(metrics: dict[str, list[tuple[int, float]]]) -> str:
    pick = lambda *keys: {k.split("/", 1)[1]: metrics[k] for k in keys if metrics.get(k)}  # noqa: E731
    charts = [
        svg_chart("training reward", pick("rollout/reward_mean", "rollout/accuracy")),
        svg_chart("tool calls per completion", pick("rollout/tool_calls_per_completion")),
        svg_chart("held-out (greedy)", pick("eval/accuracy", "eval/tool_call_rate")),
    ]
    return "".join(c for c in charts if c) or "<p>no metrics.jsonl in this run</p>"


# ---------------------------------------------------------------------------------------------------
# PAGE
# ---------------------------------------------------------------------------------------------------
CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 0; background: #fafafa; color: #222; }
#bar { position: sticky; top: 0; z-index: 2; background: #fff; border-bottom: 1px solid #ccc;
       padding: 6px 12px; }
#bar label { margin-right: 12px; }
main { padding: 0 12px 40px; }
h1 { font-size: 17px; margin: 10px 0 4px; } h2 { font-size: 15px; margin: 18px 0 6px; }
h3 { font-size: 13px; margin: 4px 0; }
.charts { display: flex; gap: 12px; flex-wrap: wrap; }
.chart { background: #fff; border: 1px solid #ddd; } .ct { font-size: 11px; font-weight: 600; }
.ax { font-size: 9px; fill: #666; } .lg { font-size: 9px; font-weight: 600; } .axis { stroke: #bbb; }
.group { background: #fff; border: 1px solid #ddd; border-radius: 4px; padding: 6px 10px; margin: 8px 0; }
.question { margin: 2px 0 6px; color: #444; }
.completion { border-top: 2px solid #e3e3e3; margin-top: 8px; padding-top: 4px; }
.completion > header { font-size: 12px; color: #333; margin-bottom: 4px; }
.msg { border-left: 3px solid #bbb; padding: 2px 8px; margin: 4px 0; }
.msg.assistant { border-color: #4a90d9; } .msg.tool { border-color: #e0a100; }
.role { font-size: 11px; color: #777; }
.toks, .text { font: 12px/1.5 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all;
               margin: 0; }
details > summary { cursor: pointer; font-size: 12px; color: #555; }
.tk { border-radius: 2px; box-shadow: inset -1px 0 rgba(0, 0, 0, .12); }
.mode-mask .tk.gen { background: #cfe3fb; } .mode-mask .tk.tool { background: #ffe29a; }
.mode-mask .tk.tmpl { background: #e6e6e6; color: #777; }
.mode-delta .tk, .mode-weight .tk { background: #f0f0f0; color: #888; }
.mode-delta .tk.d0 { background: #e8f5e9; color: #222; }
.mode-delta .tk.d1 { background: #fff3b0; color: #222; }
.mode-delta .tk.d2 { background: #ffd27a; color: #222; }
.mode-delta .tk.d3 { background: #ff9e5e; color: #222; }
.mode-delta .tk.d4 { background: #f2603c; color: #fff; }
.mode-delta .tk.d5 { background: #b3001b; color: #fff; }
.mode-weight .tk.w0 { background: #2166ac; color: #fff; }
.mode-weight .tk.w1 { background: #92c5de; color: #222; }
.mode-weight .tk.w2 { background: #d1e5f0; color: #222; }
.mode-weight .tk.w3 { background: #f7f7f7; color: #222; }
.mode-weight .tk.w4 { background: #f4a582; color: #222; }
.mode-weight .tk.w5 { background: #b2182b; color: #fff; }
.legend { display: none; font-size: 11px; margin-left: 8px; }
.legend span { padding: 0 4px; margin-right: 2px; }
.mode-mask .legend.mask, .mode-delta .legend.delta, .mode-weight .legend.weight { display: inline; }
#tip { position: fixed; z-index: 3; background: #222; color: #fff; font: 11px/1.4 ui-monospace, monospace;
       padding: 4px 6px; border-radius: 3px; white-space: pre; pointer-events: none; }
[hidden] { display: none !important; }
"""

LEGENDS = (
    '<span class="legend mask"><span class="tk gen">trained</span><span class="tk tool">tool output</span>'
    '<span class="tk tmpl">template</span></span>'
    '<span class="legend delta">|Δ logprob|: '
    + "".join(
        f'<span class="tk gen d{i}">{lo}–{hi}</span>'
        for i, (lo, hi) in enumerate(zip((0,) + DELTA_EDGES, DELTA_EDGES + ("∞",)))
    )
    + '</span><span class="legend weight">IS weight: '
    + "".join(
        f'<span class="tk gen w{i}">{lo}–{hi}</span>'
        for i, (lo, hi) in enumerate(zip((0,) + WEIGHT_EDGES, WEIGHT_EDGES + ("C",)))
    )
    + "</span>"
)

JS = """
(function () {
  var $ = function (id) { return document.getElementById(id); };
  var tip = $('tip');
  document.addEventListener('mouseover', function (e) {
    var t = e.target.closest ? e.target.closest('.tk[data-id]') : null;
    if (!t) { tip.hidden = true; return; }
    var d = t.dataset, c = t.classList;
    var kind = c.contains('gen') ? 'trained (model)' : c.contains('tool') ? 'tool output' : 'template';
    var s = 'token ' + d.id + '  ' + JSON.stringify(t.textContent) + '  ' + kind;
    if (d.b !== undefined) s += '\\nbehaviour logprob (vLLM)  ' + d.b;
    if (d.p !== undefined) s += '\\ntrainer logprob           ' + d.p;
    if (d.b !== undefined && d.p !== undefined)
      s += '\\n|Δ logprob|               ' + Math.abs(d.p - d.b).toFixed(4);
    if (d.w !== undefined) s += '\\nIS weight                 ' + d.w;
    var turn = t.closest('.turn');
    if (turn) s += '\\nturn ' + turn.dataset.turn + ', model versions ' + turn.dataset.v;
    tip.textContent = s;
    tip.style.left = Math.min(e.clientX + 12, window.innerWidth - 320) + 'px';
    tip.style.top = (e.clientY + 14) + 'px';
    tip.hidden = false;
  });
  function applyFilters() {
    var r = $('f-reward').value, s = $('f-stop').value, u = $('f-tools').value, shown = 0;
    document.querySelectorAll('.completion').forEach(function (c) {
      var d = c.dataset, n = +d.tools;
      var ok = (r === '' || d.reward === r) && (s === '' || d.stop === s) &&
        (u === '' || (u === 'with' && n > 0) || (u === 'without' && n === 0) ||
         (u === 'failed' && +d.failed > 0));
      c.hidden = !ok;
      shown += ok;
    });
    document.querySelectorAll('.group, .step').forEach(function (g) {
      g.hidden = !g.querySelector('.completion:not([hidden])');
    });
    $('shown').textContent = shown;
  }
  ['f-reward', 'f-stop', 'f-tools'].forEach(function (id) {
    $(id).addEventListener('change', applyFilters);
  });
  $('colour').addEventListener('change', function () {
    document.body.className = 'mode-' + $('colour').value;
  });
  $('expand').addEventListener('click', function () {
    document.querySelectorAll('main details').forEach(function (d) { d.open = true; });
  });
  $('collapse').addEventListener('click', function () {
    document.querySelectorAll('main details').forEach(function (d) { d.open = false; });
  });
  applyFilters();
})();
"""


def options(values) -> str:
    return "".join(f'<option value="{esc(v)}">{esc(v)}</option>' for v in values)


def render_page(run_dir: Path, rows: list[dict], metrics: dict, total_steps: int) -> str:
    by_step: dict[int, dict] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_step[r["step"]][(r.get("row_index"), r.get("admitted_version"))].append(r)
    body = []
    for step in sorted(by_step):
        groups = "".join(render_group(g) for g in by_step[step].values())
        n = sum(len(g) for g in by_step[step].values())
        head = f"<h2>step {step} · {n} completions</h2>"
        body.append(f'<section class="step" data-step="{step}">{head}{groups}</section>')
    rewards = sorted({fmt(r.get("reward")) for r in rows}, key=lambda x: float(x) if x != "–" else -1e9)
    stops = sorted({str(r.get("stop_reason")) for r in rows})
    last = {k: v[-1][1] for k, v in metrics.items() if v}
    headline = ", ".join(
        f"{label} {last[k]:.2f}"
        for label, k in [
            ("reward", "rollout/reward_mean"),
            ("accuracy", "rollout/accuracy"),
            ("held-out accuracy", "eval/accuracy"),
        ]  # fmt: skip
        if k in last
    )
    steps = f"steps {min(by_step)}–{max(by_step)}" if by_step else "no completions logged"
    steps += f" ({len(by_step)} of {total_steps} logged steps shown)"
    script_hash = base64.b64encode(hashlib.sha256(JS.encode()).digest()).decode()
    csp = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<title>rollouts · {esc(run_dir.name)}</title><style>{CSS}</style></head>
<body class="mode-mask">
<div id="bar">
<label>colour by <select id="colour"><option value="mask">loss mask</option>
<option value="delta">|Δ logprob| trainer vs vLLM</option>
<option value="weight">IS weight</option></select></label>
<label>reward <select id="f-reward"><option value="">all</option>{options(rewards)}</select></label>
<label>stop <select id="f-stop"><option value="">all</option>{options(stops)}</select></label>
<label>tool use <select id="f-tools"><option value="">all</option>
<option value="with">with tool calls</option><option value="without">without</option>
<option value="failed">a failed call</option></select></label>
<button id="expand">expand all</button> <button id="collapse">collapse all</button>
<span><b id="shown">{len(rows)}</b> of {len(rows)} completions</span>{LEGENDS}
</div>
<main>
<h1>{esc(run_dir.resolve().name)} · {esc(steps)}{" · last step: " + esc(headline) if headline else ""}</h1>
<div class="charts">{render_summary(metrics)}</div>
{"".join(body)}
</main>
<div id="tip" hidden></div>
<script>{JS}</script>
</body></html>
"""


def main(argv: list[str] | None = None) -> Path:
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    path = run_dir / "completions.jsonl"
    if not path.is_file():
        sys.exit(
            f"view_rollouts: {path} not found: give the --output-dir of a training run "
            "(it writes completions.jsonl every --log-completions-every steps)"
        )
    rows, bad = load_rows(path)
    metrics_path = run_dir / "metrics.jsonl"
    metrics, bad_metrics = load_metrics(metrics_path) if metrics_path.is_file() else ({}, 0)
    for n, p in [(bad, path), (bad_metrics, metrics_path)]:
        if n:
            print(f"view_rollouts: skipped {n} line(s) of {p} that are not JSON rows", file=sys.stderr)
    steps = sorted({r["step"] for r in rows})
    if args.last > 0:
        keep = set(steps[-args.last :])
        rows = [r for r in rows if r["step"] in keep]
    out = Path(args.out) if args.out else run_dir / "rollouts.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    # "replace": a lone surrogate (a tool name the model wrote as JSON's "\ud800") becomes "?".
    out.write_text(render_page(run_dir, rows, metrics, len(steps)), encoding="utf-8", errors="replace")
    print(f"wrote {out} ({len(rows)} completions, {out.stat().st_size / 1e6:.1f} MB)")
    return out


if __name__ == "__main__":
    main()
