"""Sample text from a trained checkpoint.

    python scripts/sample.py ckpt=outputs/DATE/TIME/checkpoints/last.ckpt prompt="It was" tokens=300

Decoding uses ``GPT.generate`` with a KV cache (``cache=false`` recomputes the whole
sequence each step, for comparison; both give the same text). Schemes that extrapolate
sample past the training length; learned PE is limited to its table: the tokens asked for
are cut to what fits, with a message.
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
    "top_p": "sample from the smallest set of tokens with this probability mass (default 1.0 = all)",
    "cache": "true: decode with a KV cache (default); false: recompute the whole sequence each step",
    "seed": "random seed (default 1337)",
    "device": "cpu or cuda (default: cuda when available)",
}


def main(argv: list[str]) -> int:
    args = parse_key_values(argv, OPTIONS)
    ckpt = checkpoint_arg(args, OPTIONS)
    import torch
    from omegaconf import OmegaConf

    from data.tokenizers import get_tokenizer
    from pelab.checkpoint import load_lit_gpt

    run_config = ckpt.parent / "config.yaml"
    tokenizer_name = OmegaConf.load(run_config).data.tokenizer if run_config.is_file() else "bytes"
    tokenizer = get_tokenizer(tokenizer_name)
    device = torch.device(args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(int(args.get("seed", 1337)))
    gpt = load_lit_gpt(ckpt, map_location=device).model.eval()

    temperature, top_k, top_p = float(args.get("temperature", 0.8)), int(args.get("top_k", 50)), \
        float(args.get("top_p", 1.0))
    cache = args.get("cache", "true").lower() in ("1", "true", "yes")
    ids = torch.tensor([tokenizer.encode(args.get("prompt", "\n"))], device=device)
    new_tokens = int(args.get("tokens", 200))
    limit = gpt.pe.max_positions
    if limit is not None and ids.shape[1] + new_tokens > limit:
        new_tokens = max(0, limit - ids.shape[1])
        print(f"[pelab] pe={gpt.pe.name} has {limit} positions: generating {new_tokens} tokens", file=sys.stderr)
    ids = gpt.generate(ids, new_tokens, temperature=temperature, top_k=top_k or None, top_p=top_p, cache=cache)
    print(tokenizer.decode(ids[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
