"""N-gram speculative decoding against plain decoding, on a repetitive workload.

    python scripts/bench_spec_decode.py [--k 4] [--concurrency 1 16 64]

The workload is what prompt lookup is for: "repeat / edit this text" chat requests over a
few source texts (prose, code, a list), greedy, up to --max-tokens each. Each concurrency
runs the same requests with speculation off (the default engine: async scheduling) and on
(`speculative_config={"method": "ngram", ...}`), in a fresh engine each, and prints output
tokens/s, the ratio, the acceptance rate and whether the texts were identical (greedy
decoding must not change with speculation).
"""

from __future__ import annotations

import argparse
import gc
import time

from jaxserve import LLM, SamplingParams

SOURCES = [
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to increase the funding for childrens books, to repair "
    "the roof before winter, and to extend the opening hours on Saturdays. The next meeting "
    "will take place on the first Monday of March.",
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n\n\ndef average_price(items):\n    if not items:\n"
    "        return 0\n    return sum(item.price for item in items) / len(items)\n",
    "Shopping list: two loaves of bread, a dozen eggs, one litre of milk, three apples, "
    "a bag of rice, olive oil, fresh basil, four tomatoes, a block of cheddar cheese, "
    "and a jar of honey.",
    "Dear Ms Alvarez, thank you for your letter of 12 May. We are pleased to confirm your "
    "booking of the conference room for the afternoon of 3 June, from two until six. "
    "Coffee and water will be provided. Please let us know if you need a projector.",
]
TASKS = [
    "Repeat the following text exactly:\n\n{}",
    "Fix any spelling mistakes in the following text and return the whole text:\n\n{}",
    "Copy this text, word for word:\n\n{}",
    "Rewrite the following text, changing nothing but the first word:\n\n{}",
]


def requests(n: int) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        src, task = SOURCES[i % len(SOURCES)], TASKS[(i // len(SOURCES)) % len(TASKS)]
        out.append([{"role": "user", "content": task.format(src)}])
    return out


def run(spec: dict | None, conc: int, n: int, max_tokens: int,
        async_scheduling: bool = True) -> tuple[float, list, dict]:
    llm = LLM(max_model_len=2048, max_num_seqs=max(conc, 1), speculative_config=spec,
              async_scheduling=async_scheduling)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    msgs = requests(n)
    llm.chat(msgs[:1], sp, use_tqdm=False)  # first-request costs out of the timing
    scheduler = llm.engine_core.scheduler
    scheduler.make_stats()  # reset the counters
    t0 = time.perf_counter()
    if conc == 1:
        outs = [o for m in msgs for o in llm.chat([m], sp, use_tqdm=False)]
    else:
        outs = llm.chat(msgs, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    stats = scheduler.make_stats().spec_decoding_stats
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    info = {}
    if stats is not None and stats.num_draft_tokens:
        info = {"acceptance": stats.num_accepted_tokens / stats.num_draft_tokens,
                "mean_accepted": stats.num_accepted_tokens / stats.num_drafts,
                "drafts": stats.num_drafts}
    llm.shutdown()
    del llm
    gc.collect()
    return sum(map(len, tokens)) / dt, tokens, info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-lookup-min", type=int, default=None)
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (default: 8 at concurrency 1, else 2 x concurrency)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--sync-baseline", action="store_true",
                   help="the 'off' run without async scheduling too (what speculation turns off)")
    a = p.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": a.k}
    if a.prompt_lookup_min is not None:
        spec["prompt_lookup_min"] = a.prompt_lookup_min
    if a.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = a.disable_by_batch_size
    print(f"speculative_config={spec}")
    for conc in a.concurrency:
        n = a.num_requests or (8 if conc == 1 else 2 * conc)
        off, off_tokens, _ = run(None, conc, n, a.max_tokens, not a.sync_baseline)
        on, on_tokens, info = run(spec, conc, n, a.max_tokens)
        same = sum(x == y for x, y in zip(off_tokens, on_tokens))
        extra = "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
        off_name = "off (sync)" if a.sync_baseline else "off"
        print(f"concurrency {conc:3d}: {n} requests, {sum(map(len, on_tokens))} tokens | {off_name} "
              f"{off:6.1f} tok/s | ngram {on:6.1f} tok/s | x{on / off:.2f} | identical "
              f"{same}/{n} | {extra}", flush=True)


if __name__ == "__main__":
    main()
