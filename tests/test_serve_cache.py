"""kvrun serve's prefix cache (--cache-mem): the PrefixCache itself on stand-in caches (fast),
and servers on the default model (slow): a chat's next turn goes on from the cache its last
turn left, with the full cache's outputs, and with a compressed method `kvrun chat`'s."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvrun.errors import KvrunError
from kvrun.run.options import size_bytes
from kvrun.server.prefix_cache import PrefixCache

SNAP = {"kv": "snapkv", "kv_budget": 0.25}
# user turns long enough that snapkv's budget keeps a part of each (its window is 32 tokens)
TURNS = [
    "Here is a short story. A lighthouse keeper lived alone on a rocky island far from the "
    "coast. Every night he climbed the stairs, lit the lamp and watched the ships pass in the "
    "dark. One winter a storm broke the lamp. What did he do next?",
    "Now tell me about the ship that was passing that night: its name, its captain, what it "
    "carried and where it was going, and why the captain was worried about the storm.",
    "Finally, describe the morning after the storm, when the sea was calm again and the "
    "keeper walked down to the shore. What did he find there?",
]


class FakeKV:
    """What PrefixCache asks of a cache: nbytes() and fork()."""

    def __init__(self, n: int, name: str):
        self.n, self.name, self.forks = n, name, 0

    def nbytes(self) -> int:
        return self.n

    def fork(self):
        self.forks += 1
        return FakeKV(self.n, f"{self.name}'")


def test_prefix_cache_takes_the_longest_proper_prefix_of_its_key():
    c = PrefixCache(1000)
    c.keep("full", [1, 2], FakeKV(10, "a"))
    c.keep("full", [1, 2, 3, 4], FakeKV(10, "b"))
    c.keep("full", [1, 2, 9], FakeKV(10, "c"))
    c.keep("snapkv", [1, 2, 3, 4, 5], FakeKV(10, "d"))
    kv, tokens = c.lookup("full", [1, 2, 3, 4, 5, 6])
    assert (kv.name, tokens) == ("b'", [1, 2, 3, 4])  # a fork of b, never b itself
    assert c.lookup("full", [1, 2, 3])[1] == [1, 2]
    assert c.lookup("full", [1, 2]) is None  # a whole prompt held: no token left to prefill
    assert c.lookup("full", [7, 1, 2, 3]) is None
    assert c.lookup("snapkv", [1, 2, 3, 4, 5, 6])[1] == [1, 2, 3, 4, 5]
    assert c.lookup("kivi2", [1, 2, 3, 4, 5, 6]) is None
    assert (len(c), c.bytes, c.evictions) == (4, 40, 0)


def test_prefix_cache_evicts_the_least_recently_used_within_its_bytes():
    c = PrefixCache(25)
    assert c.keep("k", [1], FakeKV(10, "a")) == 0
    assert c.keep("k", [2], FakeKV(10, "b")) == 0
    assert c.lookup("k", [1, 5])[1] == [1]  # a is used: b is now the oldest
    assert c.keep("k", [3], FakeKV(10, "c")) == 1
    assert c.lookup("k", [2, 5]) is None and c.lookup("k", [1, 5]) and c.lookup("k", [3, 5])
    assert c.keep("k", [3], FakeKV(12, "c2")) == 0  # the same tokens replace the older
    assert (len(c), c.bytes, c.evictions) == (2, 22, 1)
    assert c.keep("k", [4], FakeKV(26, "big")) == 0  # over the limit alone: not kept
    assert len(c) == 2 and PrefixCache(0).keep("k", [1], FakeKV(1, "x")) == 0


def test_cache_mem_sizes():
    assert size_bytes("512M", "--cache-mem") == 512 * 2**20
    assert size_bytes("2G", "--cache-mem") == 2 * 2**30
    assert size_bytes("2GiB", "--cache-mem") == 2 * 2**30
    assert size_bytes("0", "--cache-mem") == 0
    assert size_bytes("1000", "--cache-mem") == 1000
    for bad in ("-1G", "lots", ""):
        with pytest.raises(KvrunError, match="--cache-mem"):
            size_bytes(bad, "--cache-mem")


# ---------------------------------------------------------------- servers (slow)


@pytest.fixture(scope="module")
def servers(default_gguf):
    from test_serve import Served

    # float32 caches: a reused prefix then equals its recomputation to float noise (an f16
    # cache rounds K/V, and a different summation order can round an element the other way)
    kept = Served(default_gguf, "-np", "2", "--kv-dtype", "f32")
    try:
        bare = Served(default_gguf, "-np", "2", "--cache-mem", "0", "--kv-dtype", "f32")
    except Exception:
        kept.stop()
        raise
    yield kept, bare
    kept.stop()
    bare.stop()


def ask(client, msgs, n: int, **extra):
    return client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=n,
                                          temperature=0, logprobs=True, extra_body=extra or None)  # fmt: skip


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def held_by(r) -> tuple[int, int]:
    """The tokens a turn's kept cache holds: its prompt and reply, less the last reply token
    when max_tokens cut it (sampled, never fed)."""
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    return (n - 1, n) if r.choices[0].finish_reason == "length" else (n, n)


@pytest.mark.slow
def test_full_chat_turns_equal_a_server_without_the_cache(servers):
    """A 3-turn greedy chat with --kv full: every turn's text, tokens and logprobs equal a
    --cache-mem 0 server's; from turn 2 the turn goes on from the last one's whole cache
    (cached_tokens, in a streamed final usage chunk too); /metrics counts it."""
    kept, bare = servers
    a, b = kept.client(), bare.client()
    before = {m: kept.metric(f"kvrun_prefix_cache_{m}_total") for m in ("hits", "tokens")}
    msgs, last, reused = [], None, 0
    for turn, text in enumerate(TURNS):
        msgs.append({"role": "user", "content": text})
        ra, rb = ask(a, msgs, 40), ask(b, msgs, 40)
        la, lb = ra.choices[0].logprobs.content, rb.choices[0].logprobs.content
        assert ra.choices[0].message.content == rb.choices[0].message.content
        assert [e.token for e in la] == [e.token for e in lb]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(la, lb, strict=True)) < 1e-4
        assert ra.usage.prompt_tokens == rb.usage.prompt_tokens and cached(rb) == 0
        if turn == 0:
            assert cached(ra) == 0
        else:
            lo, hi = held_by(last)
            assert lo <= cached(ra) <= hi, (cached(ra), lo, hi)
            reused += cached(ra)
        last = ra
        msgs.append({"role": "assistant", "content": ra.choices[0].message.content})
    assert kept.metric("kvrun_prefix_cache_hits_total") == before["hits"] + 2
    assert kept.metric("kvrun_prefix_cache_tokens_total") == before["tokens"] + reused
    assert kept.metric("kvrun_prefix_cache_bytes") > 0 and kept.metric("kvrun_prefix_cache_entries")
    assert bare.metric("kvrun_prefix_cache_entries") == 0

    msgs.append({"role": "user", "content": "Thank you. One more sentence, please."})
    stream = a.chat.completions.create(model="smollm2", messages=msgs, max_tokens=16,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    parts, usage = [], None
    for ch in stream:
        usage = ch.usage or usage
        parts.extend(c.delta.content or "" for c in ch.choices)
    assert "".join(parts) == ask(b, msgs, 16).choices[0].message.content
    lo, hi = held_by(last)
    assert lo <= usage.prompt_tokens_details.cached_tokens <= hi


@pytest.mark.slow
def test_snapkv_chat_turns_equal_kvrun_chat(servers, default_runtime):
    """With snapkv each turn is compressed as it ends and the next prefilled on it: the served
    turns equal a Conversation (kvrun chat) on one Session fed the same turns."""
    from test_serve import CTX

    from kvrun.kv import check
    from kvrun.models.config import SamplingConfig
    from kvrun.run.chat import Conversation
    from kvrun.run.session import Session

    rt = default_runtime
    kv = rt.new_kv(check(SNAP["kv"], SNAP["kv_budget"]))
    conv = Conversation(Session(rt.model, rt.tokenizer, kv, ubatch=512, context=CTX))
    c = servers[0].client()
    msgs, last = [], None
    for turn, text in enumerate(TURNS):
        want = conv.reply(text, n_predict=40, sampling=SamplingConfig(temp=0), seed=0)
        msgs.append({"role": "user", "content": text})
        r = ask(c, msgs, 40, **SNAP)
        assert r.choices[0].message.content == want.text
        assert r.usage.completion_tokens == len(want.tokens)
        assert r.usage.model_extra["kv_bytes"] == want.stats.kv_bytes
        assert r.usage.model_extra["kv_bytes"] < r.usage.model_extra["kv_bytes_full"]
        if turn:
            lo, hi = held_by(last)
            assert lo <= cached(r) <= hi
        last = r
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    # opted out: the whole conversation prefilled and compressed at once, which here gives
    # another reply (a compressed method's output depends on where the turns were cut)
    r = ask(c, msgs[:-1], 40, cache_prompt=False, **SNAP)
    assert cached(r) == 0 and r.usage.prompt_tokens == last.usage.prompt_tokens
    assert r.choices[0].message.content != last.choices[0].message.content


@pytest.mark.slow
def test_cache_prompt_false_prefills_the_whole_prompt(servers):
    kept, _ = servers
    c = kept.client()
    msgs = [{"role": "user", "content": "Count from one to five."}]
    r = ask(c, msgs, 12)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "Now from six to ten."}]  # fmt: skip
    hits = kept.metric("kvrun_prefix_cache_hits_total")
    off = ask(c, msgs, 12, cache_prompt=False)
    on = ask(c, msgs, 12)
    assert cached(off) == 0 and cached(on) > 0
    assert off.choices[0].message.content == on.choices[0].message.content
    assert kept.metric("kvrun_prefix_cache_hits_total") == hits + 1


@pytest.mark.slow
def test_concurrent_turns_on_one_kept_prefix(servers):
    """Six next turns of one conversation at once on two slots, each on its own fork of the
    kept cache: each equals the same turn sent alone to a server without the cache, twice."""
    kept, bare = servers
    a, b = kept.client(), bare.client()
    first = [{"role": "user", "content": TURNS[0]}]
    r = ask(a, first, 24)
    base = first + [{"role": "assistant", "content": r.choices[0].message.content}]
    turns = [base + [{"role": "user", "content": f"Give me {k + 2} words about it."}]
             for k in range(6)]  # fmt: skip
    want = [ask(b, m, 16).choices[0].message.content for m in turns]
    lo, hi = held_by(r)
    for _ in range(2):
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda m: ask(a, m, 16), turns))
        assert [g.choices[0].message.content for g in got] == want
        assert all(lo <= cached(g) <= hi for g in got)


@pytest.mark.slow
def test_lru_eviction_under_a_small_cache_mem(default_gguf):
    """--cache-mem holding one conversation's cache: a second conversation's evicts it; the
    first's next turn is prefilled whole, the second's goes on from its cache; /metrics
    counts the eviction and the bytes stay within the limit."""
    from test_serve import Served

    limit = 3 * 2**20
    s = Served(default_gguf, "-np", "1", "--cache-mem", "3M", "--kv-dtype", "f32")  # sized for f32
    try:
        c = s.client()
        convs = [[{"role": "user", "content": f"Say hello to {who}."}] for who in ("Ann", "Bob")]
        for m in convs:
            r = ask(c, m, 8)
            assert limit / 2 < r.usage.model_extra["kv_bytes"] <= limit  # one fits, two do not
            m += [{"role": "assistant", "content": r.choices[0].message.content},
                  {"role": "user", "content": "And goodbye."}]  # fmt: skip
        assert s.metric("kvrun_prefix_cache_evictions_total") == 1
        assert s.metric("kvrun_prefix_cache_entries") == 1
        assert cached(ask(c, convs[1], 8)) > 0  # kept
        assert cached(ask(c, convs[0], 8)) == 0  # evicted
        assert 0 < s.metric("kvrun_prefix_cache_bytes") <= limit
        assert httpx.get(f"{s.url}/models", timeout=10).status_code == 200
    finally:
        assert s.stop() == 0


@pytest.mark.slow
def test_a_restarted_server_goes_on_from_its_cache_dir(default_gguf, tmp_path):
    """--cache-dir: a chat's turn leaves a .kvc file (written off the request's path); a new
    server on the same folder answers the next turn from it (cached_tokens; /metrics counts the
    disk hit and its bytes) with the text a prefill of the whole prompt gives, for --kv full
    and snapkv; a damaged file is dropped, not used."""
    import time

    from test_serve import Served

    msgs = [{"role": "user", "content": TURNS[0]}]
    args = ("-np", "1", "--kv-dtype", "f32", "--cache-dir", str(tmp_path), "--cache-disk", "64M")
    first = Served(default_gguf, *args)
    try:
        c = first.client()
        replies = [ask(c, msgs, 12), ask(c, msgs, 12, **SNAP)]
        deadline = time.monotonic() + 60
        while len(list(tmp_path.rglob("*.kvc"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.metric("kvrun_disk_cache_writes_total") == 2
    finally:
        assert first.stop() == 0
    files = list(tmp_path.rglob("*.kvc"))
    assert len(files) == 2 and all(f.stat().st_size > 0 for f in files)
    turns = [msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": TURNS[1]}] for r in replies]  # fmt: skip
    again = Served(default_gguf, *args)
    try:
        c = again.client()
        for turn, extra in zip(turns, [{}, SNAP], strict=True):
            r = ask(c, turn, 12, **extra)
            assert cached(r) > 0, extra
            whole = ask(c, turn, 12, cache_prompt=False, **extra)
            if not extra:  # the full cache: the same text as a prefill of the whole prompt
                assert r.choices[0].message.content == whole.choices[0].message.content
        assert again.metric("kvrun_disk_cache_hits_total") == 2
        assert again.metric("kvrun_disk_cache_hit_bytes_total") > 0
        assert 0 < again.metric("kvrun_disk_cache_bytes") <= 64 * 2**20
    finally:
        assert again.stop() == 0
    for f in tmp_path.rglob("*.kvc"):  # cut every file: the next server drops them
        f.write_bytes(f.read_bytes()[:200])
    third = Served(default_gguf, *args)
    try:
        assert cached(ask(third.client(), turns[0], 4)) == 0
        assert third.metric("kvrun_disk_cache_hits_total") == 0
    finally:
        assert third.stop() == 0


def test_a_disk_load_does_not_hold_the_engine(tmp_path, monkeypatch):
    """--cache-dir's files are read off the engine thread: while a (slowed) load of a kept
    cache is in progress, another request's tokens keep coming and the loading request has
    not started; once read, the file's cache is used (cached tokens). A damaged file is a
    miss in /metrics and is deleted; its request is answered from a whole prefill."""
    import asyncio
    import threading

    import tiny_models
    from kvrun.kv import check
    from kvrun.models.config import SamplingConfig
    from kvrun.run import kvc
    from kvrun.run.runtime import load_runtime
    from kvrun.run.session import Session
    from kvrun.server.disk_cache import DiskCache
    from kvrun.server.metrics import Metrics
    from kvrun.server.worker import EngineThread, HttpJob, StopText

    tiny = tiny_models.build(tmp_path / "tiny")
    rt = load_runtime(str(tiny.gguf_path), "float32", "cpu", log=lambda m: None)
    spec, greedy = check("full"), SamplingConfig(temp=0.0, ignore_eos=True)
    metrics, disk = Metrics(), DiskCache(tmp_path / "cache", 2**30)

    def session(rt, kv):
        return Session(rt.model, rt.tokenizer, kv, ubatch=64)

    worker = EngineThread(lambda: rt, 2, None, session, metrics, spec, None, disk)
    entered, release = threading.Event(), threading.Event()
    real_load = kvc.load

    def slow_load(*args, **kwargs):
        entered.set()
        release.wait(60)
        return real_load(*args, **kwargs)

    def misses() -> float:
        text = metrics.render(worker).decode()
        return float(text.split("\nkvrun_disk_cache_misses_total ")[1].split()[0])

    async def until(cond, what: str, seconds: float = 60) -> None:
        for _ in range(int(seconds / 0.01)):
            if cond():
                return
            await asyncio.sleep(0.01)
        pytest.fail(f"{what}: not within {seconds} s")

    async def run() -> None:
        loop = asyncio.get_running_loop()

        def submit(ids: list[int], n: int) -> HttpJob:
            job = HttpJob(list(ids), n, greedy, 0, spec, stop=StopText([]))
            job.loop, job.events = loop, asyncio.Queue()
            worker.submit(job)
            return job

        async def end(job: HttpJob):
            while (ev := await asyncio.wait_for(job.events.get(), 60))[0] != "end":
                job.text_parts.append(ev[1])
            return ev[1], ev[2]

        ids = rt.tokenizer.encode(tiny_models.TEXT)
        first = submit(ids, 4)
        result, error = await end(first)
        assert error is None
        await until(lambda: disk.stats()["files"] == 1, "the first cache written")
        turn = [*ids, *result.tokens, *ids[:6]]  # goes on from the first cache

        monkeypatch.setattr(kvc, "load", slow_load)
        other = submit(list(reversed(ids)), 1500)  # no file holds its prefix: no load
        await until(lambda: not other.events.empty(), "the other request's first token")
        waiting = submit(turn, 4)
        await until(entered.is_set, "the load")
        seen = other.events.qsize()
        await until(lambda: other.events.qsize() >= seen + 5, "tokens during the load", 20)
        assert waiting.events.empty() and waiting.kv is None  # not started: its file is read
        release.set()
        result, error = await end(waiting)
        assert error is None and waiting.cached == len(ids) + 3  # the file's tokens
        other.cancel.set()
        await end(other)
        monkeypatch.setattr(kvc, "load", real_load)

        await until(lambda: disk.stats()["files"] == 2, "the second cache written")
        cut = list((tmp_path / "cache").rglob("*.kvc"))
        for f in cut:  # the index still lists them
            f.write_bytes(f.read_bytes()[:300])
        before = misses()
        damaged = submit([*turn, *result.tokens, *ids[:3]], 4)
        result, error = await end(damaged)
        assert error is None and damaged.cached == 0 and len(result.tokens) == 4
        assert misses() == before + 1 and disk.stats()["hits"] == 1
        assert not any(f.exists() for f in cut)  # dropped (this request's own came after)

    worker.start()
    try:
        assert worker.ready.wait(60), worker.load_error
        asyncio.run(run())
    finally:
        release.set()
        worker.close()
