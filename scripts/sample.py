"""Sample text from a trained checkpoint.

    python scripts/sample.py ckpt=outputs/DATE/TIME/checkpoints/last.ckpt prompt="It was" tokens=300

Decoding recomputes the whole prefix each step (no KV cache yet), with explicit positions
0..T-1, so every scheme — including those that extrapolate — samples past the training
length, and learned PE stops at its table size with a clear message.
"""

from __future__ import annotations

import sys

from _common import checkpoint_arg, parse_key_values

OPTIONS = {
    "ckpt": "path to a checkpoint written by train.py (required)",
    "prompt": "text to continue (default: a newline)",
    "tokens": "number of new tokens (default 200)",
    "temperature": "softmax temperature (default 0.8; 0 = greedy)",
    "top_k": "sample among the k most likely tokens (default 50; 0 = all)",
    "seed": "random seed (default 1337)",
    "device": "cpu or cuda (default: cuda when available)",
}


def main(argv: list[str]) -> int:
    args = parse_key_values(argv, OPTIONS)
    ckpt = checkpoint_arg(args, OPTIONS)
    import torch
    from omegaconf import OmegaConf

    from data.tokenizers import get_tokenizer
    from model.checkpoint import load_lit_gpt

    run_config = ckpt.parent / "config.yaml"
    tokenizer_name = OmegaConf.load(run_config).data.tokenizer if run_config.is_file() else "bytes"
    tokenizer = get_tokenizer(tokenizer_name)
    device = torch.device(args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(int(args.get("seed", 1337)))
    gpt = load_lit_gpt(ckpt, map_location=device).model.eval()

    temperature, top_k = float(args.get("temperature", 0.8)), int(args.get("top_k", 50))
    ids = torch.tensor([tokenizer.encode(args.get("prompt", "\n"))], device=device)
    limit = gpt.pe.max_positions
    with torch.no_grad():
        for _ in range(int(args.get("tokens", 200))):
            if limit is not None and ids.shape[1] >= limit:
                print(f"\n[pelab] stopped: pe={gpt.pe.name} has {limit} positions", file=sys.stderr)
                break
            logits = gpt.logits(gpt.hidden(ids)[:, -1])
            if temperature == 0:
                next_id = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1)
            ids = torch.cat([ids, next_id], dim=1)
    print(tokenizer.decode(ids[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
