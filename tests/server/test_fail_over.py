"""AsyncEngine's fail-over: when a process the engine needs is lost, every open stream resumes on the fallback
engine from the tokens it already has, and ends with the text one engine gives (greedy)."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.server.async_engine import AsyncEngine


def test_a_lost_engine_fails_over_and_every_stream_goes_on(llm):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 5000, int(n)).tolist() for n in rng.integers(5, 200, 6)]
    params = [
        SamplingParams(max_tokens=16, stop=["the end of it"]),  # a stop string: its prefixes are held back
        # seeded draws go on from the token index they reached; the penalty and min_tokens read the tokens
        # it had
        SamplingParams(max_tokens=16, temperature=0.8, seed=7, presence_penalty=0.5, min_tokens=14),
    ] * 3
    want = [(c.token_ids, c.text) for c in llm.generate(prompts, params)]
    first, fallback = llm.builder.engine(progress=False), llm.builder.engine(progress=False)
    lost: list[str] = []

    async def main():
        engine = AsyncEngine(first, max_queue=16, lost=lambda: lost[0] if lost else None, fallback=lambda: fallback)
        engine.start()
        got = [([], "") for _ in prompts]

        async def read(k: int, stream) -> None:
            async for out in stream:
                got[k] = (got[k][0] + out.new_token_ids, got[k][1] + out.new_text)

        readers = [asyncio.create_task(read(k, engine.submit(p, sp))) for k, (p, sp) in enumerate(zip(prompts, params))]
        while sum(len(ids) for ids, _ in got) < 20:  # some streams have tokens, none is done
            await asyncio.sleep(0.005)
        assert engine.healthy and not engine.failed_over
        lost.append("process 1 stopped answering")
        assert engine.check_lost() == "process 1 stopped answering"
        await asyncio.wait_for(asyncio.gather(*readers), 600)
        assert engine.failed_over and engine.healthy and engine.engine is fallback and engine.accepting
        # the retired thread ends after its step on the first engine (never the fallback's: it would drop
        # outputs), which may be compiling a program: seconds on a small CPU
        engine.stop(300)
        assert engine.threads_alive == 0
        return got

    assert asyncio.run(main()) == want


def test_a_fallback_that_cannot_be_built_ends_every_stream_with_process_gone(llm):
    from jaxserve.server.async_engine import ProcessGone

    prompts = [[101, 102, 103, 104] * k for k in range(1, 4)]
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    lost: list[str] = []

    def fallback():
        raise RuntimeError("no device left")

    async def main():
        engine = AsyncEngine(
            llm.builder.engine(progress=False), max_queue=16, lost=lambda: lost[0] if lost else None, fallback=fallback
        )
        engine.start()
        streams = [engine.submit(p, params) for p in prompts]
        first = [await stream.__anext__() for stream in streams]  # every stream has started
        assert all(out.new_token_ids for out in first)
        lost.append("process 1 stopped answering")
        engine.check_lost()
        for stream in streams:
            with pytest.raises(ProcessGone, match="no device left"):
                async for _ in stream:
                    pass
        assert not engine.accepting and not engine.healthy and not engine.failed_over
        # its thread ends after its step, which may be compiling a program (seconds on a small CPU): wait for it,
        # or the process would exit with XLA mid-compile in a daemon thread
        engine.stop(300)
        assert engine.threads_alive == 0

    asyncio.run(asyncio.wait_for(main(), 600))


def test_the_fail_over_engine_runs_the_programs_prepared_while_another_served():
    """LLM.prepare_fail_over compiles the fail-over engine's programs from shapes alone (nothing placed); the
    engine fail_over builds runs those very programs, none compiled again, and gives the first engine's tokens."""
    import jaxserve

    llm = jaxserve.LLM(
        "random:tiny",
        max_model_len=256,
        kv_cache_tokens=512,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        warmup=True,
        progress=False,
    )
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 90)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3)
    want = [c.token_ids for c in llm.generate(prompts, params)]
    llm.prepare_fail_over()
    prepared, done, _ = llm.builder._fail_over_programs
    assert not prepared.placed and all(not isinstance(x, jax.Array) for x in jax.tree.leaves(prepared.caches))
    done.result(600)
    programs = prepared.compiled_programs()
    assert set(programs) == set(prepared.programs())
    engine = llm.fail_over()
    assert all(engine.runner.compiled_programs()[p] is programs[p] for p in programs)
    assert len(engine.runner.compiled_programs()) == len(programs)  # warmup found every one compiled
    assert [c.token_ids for c in llm.generate(prompts, params)] == want
