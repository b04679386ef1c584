"""A multi-turn chat through kvrun serve with and without its prefix cache (--cache-mem),
beside llama-server (cache_prompt on, its default), on the same GGUF and thread count.

    python bench/serve_chat.py                      # default model, 6 turns, 2 threads
    python bench/serve_chat.py --chat-turns 6 --turn-tokens 300 --write

Each server is started afresh with one slot and runs one conversation with the official
openai client: --chat-turns user turns of about --turn-tokens tokens of text each, every
reply a streamed greedy answer of up to --max-tokens tokens that joins the history, so turn k
re-sends everything before it (as chat clients do). Measured per turn: time to first token
(request sent -> first content chunk) and the prompt tokens the server says it took from a
kept cache (usage.prompt_tokens_details.cached_tokens; llama-server's own
timings.cache_n). Settings (--servers): kvrun-full and kvrun-snapkv (`--kv snapkv
--kv-budget 0.25`) with the default --cache-mem, the same with `--cache-mem 0` (-nocache),
and llama-server. A warm-up request (another prompt) runs first on each server. The last
column checks that kvrun-full's replies with the cache are the text of those without.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
import vs_llamacpp as vl  # noqa: E402
from bench_harness import log, write_section  # noqa: E402
from serve import Running, free_port, llama_server_binary  # noqa: E402

HERE = Path(__file__).parent
README = HERE / "README.md"
BEGIN, END = "<!-- serve-chat:begin -->", "<!-- serve-chat:end -->"
SETTINGS = {  # name -> kvrun serve's arguments (None: llama-server)
    "kvrun-full": ["--kv", "full"],
    "kvrun-full-nocache": ["--kv", "full", "--cache-mem", "0"],
    "kvrun-snapkv": ["--kv", "snapkv", "--kv-budget", "0.25"],
    "kvrun-snapkv-nocache": ["--kv", "snapkv", "--kv-budget", "0.25", "--cache-mem", "0"],
    "llama-server": None,
}
SUBJECTS = ["a harbour town", "a mountain railway", "an old observatory", "a river delta",
            "a desert market", "a northern forest", "a island school", "a glass factory"]  # fmt: skip
SENTENCES = [
    "In the early morning the streets of {s} are quiet, and the only sound is the wind.",
    "People who have lived near {s} for years say that every season changes it completely.",
    "The oldest building there was repaired three times, and each repair left its own marks.",
    "Traders arrive before noon with baskets of bread, fish, cloth, copper pots and spices.",
    "Children walk to school along a road lined with poplars, counting the carts they pass.",
    "By the afternoon the light turns golden and the shadows stretch across the square.",
    "An old map in the town hall shows paths that nobody has walked for a hundred years.",
    "When it rains, water runs down the steep lanes and gathers in the lower gardens.",
    "Visitors often ask about the bell that rings at odd hours, and nobody agrees why.",
    "In the evening the lamps are lit one by one, and the smell of cooking fills the air.",
]


def user_turn(k: int, tokens: int) -> str:
    """About `tokens` tokens: a description of a place, and a question about it."""
    s = SUBJECTS[k % len(SUBJECTS)]
    parts = [f"Part {k + 1} of my notes, about {s}."]
    i = 0
    while len(" ".join(parts).split()) * 5 < tokens * 4:  # ~5/4 tokens a word
        parts.append(SENTENCES[(i + k) % len(SENTENCES)].format(s=s))
        i += 1
    parts.append(f"Summarize what is special about {s} in a few sentences.")
    return " ".join(parts)


def command(name: str, model: str, port: int, a) -> list[str]:
    if SETTINGS[name] is None:
        return [str(llama_server_binary()), "-m", model, "--port", str(port), "-np", "1",
                "-c", str(a.ctx), "-t", str(a.threads), "-tb", str(a.threads), "--no-webui"]  # fmt: skip
    return [sys.executable, "-m", "kvrun", "serve", "-m", model, "--port", str(port), "-np", "1",
            "-c", str(a.ctx), "--device", a.device, "--alias", "model", *SETTINGS[name]]  # fmt: skip


def turn(client: openai.OpenAI, msgs: list[dict], a) -> dict:
    """One streamed turn: its TTFT, reply, prompt and cached tokens."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="model", messages=msgs, max_tokens=a.max_tokens,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    ttft, parts, usage, extra = None, [], None, {}
    for ch in stream:
        for c in ch.choices:
            if c.delta.content:
                ttft = ttft or time.perf_counter() - t0
                parts.append(c.delta.content)
        usage = ch.usage or usage
        extra = ch.model_extra.get("timings") or extra  # llama-server's
    details = getattr(usage, "prompt_tokens_details", None)
    cached = details.cached_tokens if details and details.cached_tokens is not None else None
    if cached is None and extra:
        cached = extra.get("cache_n")
    return {"ttft": ttft, "text": "".join(parts), "prompt": usage.prompt_tokens, "cached": cached}


def conversation(name: str, model: str, a, env) -> list[dict] | str:
    port = free_port()
    try:
        srv = Running(command(name, model, port, a), port, env)
    except (RuntimeError, OSError, SystemExit) as e:
        return f"start: {e}"
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=1200)  # fmt: skip
        turn(client, [{"role": "user", "content": "Say hello."}], argparse.Namespace(max_tokens=4))
        msgs, rows = [], []
        for k in range(a.chat_turns):
            msgs.append({"role": "user", "content": user_turn(k, a.turn_tokens)})
            row = turn(client, msgs, a)
            log(f"  turn {k + 1}: {row['prompt']} prompt tokens ({row['cached']} cached), "
                f"TTFT {row['ttft']:.3f} s")  # fmt: skip
            rows.append(row)
            msgs.append({"role": "assistant", "content": row["text"]})
        return rows
    except Exception as e:  # noqa: BLE001 - recorded, the others still run
        return f"{type(e).__name__}: {e}"
    finally:
        srv.stop()


def table(runs: dict, turns: int) -> str:
    names = list(runs)
    head = ["turn", "prompt tokens"]
    for n in names:
        head.append(f"{n} TTFT (s)" + ("" if "nocache" in n else " [cached]"))
    ratio = [n for n in ("kvrun-full", "kvrun-snapkv") if n in runs and f"{n}-nocache" in runs]
    head += [f"{n} cache / no cache" for n in ratio]
    same = "kvrun-full" in runs and "kvrun-full-nocache" in runs
    head += ["full: same text"] if same else []
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in range(turns):
        first = next((r for r in runs.values() if isinstance(r, list)), None)
        cells = [str(k + 1), str(first[k]["prompt"]) if first else "-"]
        for n in names:
            r = runs[n]
            if not isinstance(r, list):
                cells.append(f"failed: {r[:60]}" if k == 0 else "")
                continue
            cached = "" if "nocache" in n else f" [{r[k]['cached']}]"
            cells.append(f"{r[k]['ttft']:.3f}{cached}")
        for n in ratio:
            on, off = runs[n], runs[f"{n}-nocache"]
            ok = isinstance(on, list) and isinstance(off, list)
            cells.append(f"{on[k]['ttft'] / off[k]['ttft']:.2f}x" if ok else "-")
        if same:
            on, off = runs["kvrun-full"], runs["kvrun-full-nocache"]
            ok = isinstance(on, list) and isinstance(off, list)
            cells.append(("yes" if on[k]["text"] == off[k]["text"] else "NO") if ok else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF path or name (default smollm2)")
    ap.add_argument("--chat-turns", type=int, default=6)
    ap.add_argument("--turn-tokens", type=int, default=300, help="about this many a user turn")
    ap.add_argument("--max-tokens", type=int, default=64, help="a reply's limit")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--servers", default=",".join(SETTINGS))
    ap.add_argument("--json", default=None, help="write the turns here too")
    ap.add_argument("--write", action="store_true", help="update bench/README.md")
    a = ap.parse_args()
    import torch

    from kvrun.hub.model_store import resolve
    from kvrun.tasks.bench import machine

    model = str(resolve(a.model, pull_missing=True, log=log))
    env = vl.thread_env(a.threads)
    runs = {}
    for name in a.servers.split(","):
        if name not in SETTINGS:
            raise SystemExit(f"unknown server {name!r} (known: {', '.join(SETTINGS)})")
        log(f"{name}: {a.chat_turns} turns")
        runs[name] = conversation(name, model, a, env)
    cmd = "python " + shlex.join(sys.argv)
    dev = machine(torch.device(a.device))["device_name"]
    text = (f"`{cmd}` ({dt.date.today()}, {dev}, {a.threads} threads; TTFT per turn, "
            f"[cached prompt tokens])\n\n{table(runs, a.chat_turns)}")  # fmt: skip
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    if a.write:
        write_section(README, f"### A chat with the prefix cache\n\n{text}", BEGIN, END)


if __name__ == "__main__":
    main()
