"""A stand-in for specbench/bench/vllm_worker.py that speaks the same JSON-lines protocol without vLLM,
so the adapter (process handling, counters, records) is tested on machines without vLLM.

Its "model" continues a prompt with (last id + 1) mod 64 until it hits id 2 (EOS) or the token
budget; its spec-decode counters grow by a fixed pattern per generated request: per request with
n ≥ 2 tokens, 1 draft round of k = 3 tokens of which 2 accepted (positions 1 and 2).
FAKE_VLLM_FAIL=generate makes every generate fail; FAKE_VLLM_FAIL=init makes init fail.
"""
import json
import os
import sys

K = 3


def main():
    counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * K}
    fail = os.environ.get("FAKE_VLLM_FAIL", "")
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "shutdown":
            print(json.dumps({"ok": True}), flush=True)
            return
        if msg["op"] == "init":
            if fail == "init":
                print(json.dumps({"ok": False, "error": "ValueError: no such model"}), flush=True)
                continue
            reply = {"ok": True, "vllm_version": "0.0-fake", "dtype": msg["engine_args"]["dtype"], "device": "cpu",
                     "max_num_seqs": 8, "num_speculative_tokens": K}
        elif fail == "generate":
            print(json.dumps({"ok": False, "error": "RuntimeError: boom"}), flush=True)
            continue
        else:
            before = json.loads(json.dumps(counters))
            outputs = []
            for p in msg["prompts"]:
                ids, t = [], p[-1]
                while len(ids) < msg["max_tokens"]:
                    t = (t + 1) % 64
                    ids.append(t)
                    if t in msg["stop_token_ids"]:
                        break
                if len(ids) >= 2:
                    counters["num_drafts"] += 1
                    counters["num_draft_tokens"] += K
                    counters["num_accepted_tokens"] += 2
                    counters["accepted_per_pos"][0] += 1
                    counters["accepted_per_pos"][1] += 1
                outputs.append({"ids": ids, "finish_reason": "stop" if ids[-1] == 2 else "length",
                                "ttft_s": 0.01, "decode_s": 0.001 * len(ids)})
            reply = {"ok": True, "wall_s": 0.5, "outputs": outputs, "counters_before": before,
                     "counters_after": counters}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
