"""The rollout viewer on a real run: train_async_grpo.py as a subprocess for 2 steps on models/tiny-warm
with --log-completions-every 1 (on the session's server as `trainer_server`: the run pushes its weights into
it), then scripts/view_rollouts.py, and the page driven in a real headless browser
(Debian's Chromium through Playwright's Python package; never a browser Playwright downloads).

VIEWER_RECORDED_RUN=DIR reuses the run dir of an earlier recording instead of training again (for
iterating on the page; `make test` always records)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
IS_CAP = 2.0


@pytest.fixture(scope="module")
def recorded_run(request, tmp_path_factory) -> tuple[Path, list[dict]]:
    """(run dir, completions.jsonl rows) of one short real run."""
    if os.environ.get("VIEWER_RECORDED_RUN"):
        out = Path(os.environ["VIEWER_RECORDED_RUN"])
    else:
        model = REPO / "models" / "tiny-warm"
        if not (model / "config.json").exists():
            pytest.fail(f"{model} missing: run `make tiny-model` (make test does it for you)")
        out = tmp_path_factory.mktemp("viewer") / "run"
        cmd = [
            sys.executable, str(REPO / "train_async_grpo.py"), "--model", str(model), "--env", "retool",
            "--output-dir", str(out), "--max-steps", "2", "--prompts-per-step", "2", "--num-generations", "4",
            "--max-context", "512", "--max-turns", "2", "--keep-zero-variance", "--lr", "1e-4",
            "--is-cap", str(IS_CAP), "--log-completions-every", "1", "--save-every", "1000",
            "--batch-timeout", "300", "--vllm-url", request.getfixturevalue("trainer_server").url,
        ]  # fmt: skip
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    return out, rows


def view(run_dir: Path, out: Path) -> Path:
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "view_rollouts.py"), str(run_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (requirements.txt; make install)"
    )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(
            f"no Chromium at {CHROMIUM}: `apt-get install chromium` (make test installs it where it can)"
        )
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        yield b
        b.close()


def open_page(browser, path: Path):
    """The page, and the console errors, page errors and non-file requests it produced."""
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    problems = []
    page.on(
        "console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: None if r.url.startswith("file://") else problems.append(f"request {r.url}"))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return page, problems


def visible_completions(page) -> int:
    return page.locator(".completion:visible").count()


# ---------------------------------------------------------------------------------------------------
# THE ROWS: what the trainer writes
# ---------------------------------------------------------------------------------------------------
def test_rows_carry_the_token_view(recorded_run):
    _, rows = recorded_run
    assert sorted({r["step"] for r in rows}) == [1, 2]
    assert [sum(r["step"] == s for r in rows) for s in (1, 2)] == [4, 4]  # 2 groups × best and worst
    kinds = ""
    for r in rows:
        # The keys rows had before the viewer are still there.
        for key in ["step", "question", "answer", "text", "reward", "stop_reason", "tool_calls",
                    "admitted_version", "row_index"]:  # fmt: skip
            assert key in r, key
        tok = r["tokens"]
        n = len(tok["ids"])
        assert n > 0 and r["tokens_dropped"] == 0
        for key in ["pieces", "mask", "behaviour_logprob", "trainer_logprob", "is_weight"]:
            assert len(tok[key]) == n, key
        assert len(tok["kind"]) == n and set(tok["kind"]) <= set("mtc")
        assert r["text"].endswith("".join(tok["pieces"]))  # the pieces are the completion's text
        assert sum(t["generated"] + t["appended"] for t in r["turns"]) == n
        for t in r["turns"]:
            a, g = t["start"], t["generated"]
            assert tok["mask"][a : a + g] == [1] * g and tok["kind"][a : a + g] == "m" * g
            assert 0 <= t["model_versions"][0] <= t["model_versions"][1] < r["step"]
            # The tool results are exactly the tokens marked "t" in the suffix their turn appended.
            tool_text = "".join(
                p
                for p, k in zip(tok["pieces"][a + g : a + g + t["appended"]], tok["kind"][a + g :])
                if k == "t"
            )
            for c in [c for c in r["tool_calls"] if c["turn"] == r["turns"].index(t)]:
                assert c["duration_s"] >= 0
                assert c["result"] in tool_text and len(tool_text) - len(c["result"]) <= 2, (c, tool_text)
        for m, k, mu, pi, w in zip(tok["mask"], tok["kind"], tok["behaviour_logprob"], tok["trainer_logprob"],
                                   tok["is_weight"]):  # fmt: skip
            assert m == (k == "m") and pi is not None and math.isfinite(pi) and pi <= 0
            if m:
                assert w == pytest.approx(min(math.exp(pi - mu), IS_CAP), abs=2e-4)
            else:
                assert mu is None and w is None
        kinds += tok["kind"]
        assert len(json.dumps(r)) < 250_000
    assert {"m", "t", "c"} <= set(kinds)  # tiny-warm calls the tool: trained, tool and template tokens
    # The trainer's logprobs are those of the tokens vLLM sampled (an off-by-one shift would put them
    # nats apart): the same weights at step 1, so they agree up to kernels and sampling processors.
    deltas = [
        abs(pi - mu)
        for r in rows
        if r["step"] == 1
        for pi, mu, m in zip(
            r["tokens"]["trainer_logprob"], r["tokens"]["behaviour_logprob"], r["tokens"]["mask"]
        )
        if m
    ]
    # Mean, not median: the tiny model is so sure of most tokens that a shifted array's median is small
    # too (measured: mean < 1e-4 aligned, 0.31 shifted by one token).
    assert sum(deltas) / len(deltas) < 0.1, sum(deltas) / len(deltas)


# ---------------------------------------------------------------------------------------------------
# THE PAGE, in Chromium
# ---------------------------------------------------------------------------------------------------
def test_page_shows_every_completion_with_tokens_by_kind_hover_and_colour_toggle(
    recorded_run, browser, tmp_path
):
    run_dir, rows = recorded_run
    page, problems = open_page(browser, view(run_dir, tmp_path / "rollouts.html"))
    assert page.locator(".completion").count() == len(rows) == visible_completions(page)
    assert page.locator("#shown").inner_text() == str(len(rows))
    assert page.locator(".chart").count() >= 2  # reward and tool calls over steps, from metrics.jsonl
    # Each chart names its series in the series' own colour, and no two series of a chart share one.
    style = lambda x, prop: x.evaluate(f"e => getComputedStyle(e).{prop}")  # noqa: E731
    for chart in page.locator(".chart").all():
        lines, labels = chart.locator("polyline").all(), chart.locator(".lg").all()
        assert len(labels) == len(lines) >= 1
        strokes = [style(line, "stroke") for line in lines]
        assert [style(label, "fill") for label in labels] == strokes and len(set(strokes)) == len(strokes)
    assert max(len(chart.locator("polyline").all()) for chart in page.locator(".chart").all()) >= 2
    page.click("#expand")
    gen, tool, tmpl = (
        page.locator("main .tk.gen").first,
        page.locator("main .tk.tool").first,
        page.locator("main .tk.tmpl").first,
    )
    classes = [set(x.get_attribute("class").split()) for x in (gen, tool, tmpl)]
    assert classes[0] != classes[1] and {"gen", "tool"} & classes[0] & classes[1] == set()
    background = lambda x: x.evaluate("e => getComputedStyle(e).backgroundColor")  # noqa: E731
    assert len({background(gen), background(tool), background(tmpl)}) == 3
    assert page.locator("main .tk.gen").count() == sum(sum(r["tokens"]["mask"]) for r in rows)

    # Hover: the token's numbers.
    gen.hover()
    tip = page.locator("#tip")
    assert tip.is_visible()
    assert f"trainer logprob           {gen.get_attribute('data-p')}" in tip.inner_text()
    assert "IS weight" in tip.inner_text() and "model versions" in tip.inner_text()

    # The toggle recolours trained tokens: one with |Δ| < 0.01 and an IS weight near 1 has a colour of
    # its own in each mode.
    token = page.locator("main .tk.gen.d0.w3").first
    before = background(token)
    page.select_option("#colour", "delta")
    in_delta = background(token)
    assert in_delta != background(tmpl)  # a bucket's colour, not the grey of untrained tokens
    page.select_option("#colour", "weight")
    in_weight = background(token)
    assert in_weight != background(tmpl)
    assert len({before, in_delta, in_weight}) == 3, (before, in_delta, in_weight)
    page.select_option("#colour", "mask")
    assert background(token) == before
    assert problems == []


def test_filters_hide_what_they_should(recorded_run, browser, tmp_path):
    run_dir, rows = recorded_run
    page, problems = open_page(browser, view(run_dir, tmp_path / "rollouts.html"))
    rewards = page.locator("#f-reward option").evaluate_all("os => os.map(o => o.value).filter(v => v)")
    assert sorted(rewards) == sorted({f"{r['reward']:.2f}" for r in rows})
    for value in rewards:
        page.select_option("#f-reward", value)
        expected = sum(f"{r['reward']:.2f}" == value for r in rows)
        assert visible_completions(page) == expected == int(page.locator("#shown").inner_text())
    page.select_option("#f-reward", "")
    hid_some = False
    for value, keep in [
        ("with", lambda r: len(r["tool_calls"]) > 0),
        ("without", lambda r: not r["tool_calls"]),
        ("failed", lambda r: any(c["failed"] for c in r["tool_calls"])),
    ]:
        page.select_option("#f-tools", value)
        expected = sum(keep(r) for r in rows)
        assert visible_completions(page) == expected, value
        hid_some |= expected < len(rows)
        if expected == 0:  # nothing left: the step sections go too
            assert page.locator(".step:visible").count() == 0
    assert hid_some
    page.select_option("#f-tools", "")
    stop = rows[0]["stop_reason"]
    page.select_option("#f-stop", stop)
    assert visible_completions(page) == sum(r["stop_reason"] == stop for r in rows)
    page.select_option("#f-stop", "")
    assert visible_completions(page) == len(rows)
    assert problems == []


def test_hostile_completion_is_shown_as_text_and_never_runs(recorded_run, browser, tmp_path):
    """Model output, tool results, questions and even stop reasons are data: a `<script>` in any of them
    must show as text and not execute, nor break out of an attribute."""
    _, rows = recorded_run
    row = json.loads(json.dumps(next(r for r in rows if r["tool_calls"])))
    payload = "<script>window.__pwned = 1</script>"
    row["tokens"]["pieces"][0] = payload
    row["question"] = '<img src="x" onerror="window.__pwned = 2">'
    row["tool_calls"][0]["result"] = "</details></code><script>window.__pwned = 3</script>"
    row["stop_reason"] = '"><script>window.__pwned = 4</script>'
    row["prompt_messages"][-1]["content"] = "</div><script>window.__pwned = 5</script>"
    run_dir = tmp_path / "hostile"
    run_dir.mkdir()
    (run_dir / "completions.jsonl").write_text(json.dumps(row) + "\n")
    page, problems = open_page(browser, view(run_dir, tmp_path / "hostile.html"))
    assert page.evaluate("window.__pwned") is None
    assert page.locator("script").count() == 1 and page.locator("main img").count() == 0
    page.click("#expand")
    text = page.locator("main").inner_text()
    assert payload in text and "window.__pwned = 3" in text and "onerror" in text
    assert page.locator(".completion").count() == 1
    assert problems == []


def test_missing_run_is_one_clear_line(tmp_path):
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "view_rollouts.py"), str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "completions.jsonl not found" in r.stderr and "--output-dir" in r.stderr


def test_a_row_cut_at_the_token_cap_keeps_every_tool_call():
    """A completion longer than MAX_LOGGED_TOKENS: its row's token arrays stop at the cap, but its tool
    calls are all there (the viewer counts them and its filters file the row by them); a failed call
    after the cap had vanished, filing the row under 'no tool calls'."""
    from transformers import AutoTokenizer

    from metrics import MAX_LOGGED_TOKENS, trajectory_record
    from records import RolloutCompletion, RolloutGroup, ToolCallRecord, TurnRecord, group_metrics

    c = RolloutCompletion(prompt_len=2, prompt_messages=[])
    c.add_turn(TurnRecord((100,) * MAX_LOGGED_TOKENS, (-0.1,) * MAX_LOGGED_TOKENS, "stop", (0, 0)))
    c.append_context([101, 102])
    c.add_turn(TurnRecord((103, 104), (-0.1, -0.1), "stop", (0, 0)))
    c.append_context([105], (ToolCallRecord("code_interpreter", {"code": "1/0"}, "ZeroDivisionError", True),))
    c.add_turn(TurnRecord((106,), (-0.1,), "stop", (0, 0)))
    group = RolloutGroup([], [1, 2], {"_index": 0}, [c, c], [0.0, 0.0], [0.0, 0.0], 0, group_metrics([c, c]))
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny")  # what `make test-fast` builds
    row = trajectory_record(group, 0, 1, tokenizer)
    assert len(row["tokens"]["ids"]) == MAX_LOGGED_TOKENS and row["tokens_dropped"] == 6
    assert [(x["name"], x["failed"], x["turn"]) for x in row["tool_calls"]] == [("code_interpreter", True, 1)]


def test_a_resumed_runs_steps_show_its_own_rows(tmp_path):
    """A run killed after logging step 3 and resumed from its step-2 checkpoint writes step 3 again: the
    page shows that step's rows of the resumed run alone (both were shown, as one group of 4)."""
    rows = [{"step": 2, "writer": "killed", "row_index": 0, "question": "q2"}]
    rows += [{"step": 3, "writer": "killed", "row_index": 1, "question": "killed's"} for _ in range(2)]
    rows += [{"step": 3, "writer": "resumed", "row_index": 1, "question": "resumed's"} for _ in range(2)]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "page.html"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "view_rollouts.py"), str(tmp_path), "--out", str(out)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    page = out.read_text()
    assert "step 3 · 2 completions" in page and "resumed&#x27;s" in page and "killed&#x27;s" not in page
    assert "step 2 · 1 completions" in page


@pytest.mark.parametrize("text", ["x = 1 🎉🎉", "数学 ok", "plain"])
def test_token_pieces_join_to_the_decoded_text_even_cut_inside_a_character(text):
    """ "".join(pieces) == decode(ids), also for ids cut inside a multi-byte character (a generation
    stopped by its length): those tokens' text was lost, and they showed with no width."""
    from transformers import AutoTokenizer

    from metrics import token_pieces

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny")  # what `make test-fast` builds
    ids = tokenizer.encode(text, add_special_tokens=False)
    for cut in (ids, ids[:-1]):
        assert "".join(token_pieces(tokenizer, cut)) == tokenizer.decode(cut)


def test_a_tool_name_written_as_a_lone_surrogate_still_makes_a_page(tmp_path):
    """JSON lets the model name its tool "\\ud800", a lone surrogate: the rollout keeps the call (failed,
    unknown tool) under that name, and the viewer, writing the page as UTF-8, died with a
    UnicodeEncodeError traceback."""
    import asyncio
    import concurrent.futures

    from transformers import AutoTokenizer

    from chat_format import ChatTemplate
    from metrics import write_completions
    from records import RolloutCompletion, RolloutGroup, TurnRecord, group_metrics
    from rollout import run_tool

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny")  # what `make test-fast` builds
    template = ChatTemplate(tokenizer)
    text = '<tool_call>\n{"name": "\\ud800", "arguments": {}}\n</tool_call>'
    (name, args, error), *_ = template.parse_tool_calls(text)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the browser tests' sync API holds our loop
        call = pool.submit(asyncio.run, run_tool({}, name, args, error)).result()
    assert call.name == "\ud800" and call.failed
    ids = tokenizer.encode(text, add_special_tokens=False)
    c = RolloutCompletion(prompt_len=2, prompt_messages=[{"role": "user", "content": "q"}])
    c.add_turn(TurnRecord(tuple(ids), (-0.1,) * len(ids), "stop", (0, 0)))
    tool_message = {"role": "tool", "name": call.name, "content": call.result}
    c.append_context(template.tool_response_ids([tool_message], text), (call,))
    group = RolloutGroup([], [1, 2], {"_index": 0}, [c, c], [0.0, 0.0], [0.0, 0.0], 0, group_metrics([c, c]))
    with open(tmp_path / "completions.jsonl", "w") as f:
        write_completions(f, [group], [(0, 0, 0)], {}, 1, tokenizer, IS_CAP)
    page = view(tmp_path, tmp_path / "page.html").read_text(encoding="utf-8")
    assert "tool call: ? (0.00 s, failed)" in page


def test_a_cut_metrics_line_is_skipped_with_a_count(tmp_path):
    """A trainer killed mid-write leaves metrics.jsonl with a cut last line: the page still shows the
    lines before it, and says on stderr what it skipped (a JSONDecodeError traceback and no page)."""
    (tmp_path / "completions.jsonl").write_text(json.dumps({"step": 1, "row_index": 0, "reward": 1.0}) + "\n")
    lines = [json.dumps({"step": s, "rollout/reward_mean": 0.25 * s}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "rollout/rew')
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "view_rollouts.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (
        r.stderr.strip()
        == f"view_rollouts: skipped 1 line(s) of {tmp_path / 'metrics.jsonl'} that are not JSON rows"
    )
    page = (tmp_path / "rollouts.html").read_text()
    assert "last step: reward 0.50" in page and page.count("<polyline") == 1
