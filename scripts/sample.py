"""Sample text from a trained checkpoint.

    python scripts/sample.py ckpt=outputs/DATE/TIME/checkpoints/last.ckpt prompt="It was" tokens=300

Decoding uses ``GPT.generate`` with a KV cache (``cache=false`` recomputes the whole
sequence each step, for comparison; both give the same text). Schemes that extrapolate
sample past the training length; learned PE is limited to its table: the tokens asked for
are cut to what fits, with a message.
"""

from __future__ import annotations

import sys

from _cli import command_line
from _common import bad_value, checked_checkpoint, device_arg, flag, integer, number, required


def parse_options(cfg) -> dict:
    """Every sampling option checked (one line naming it) before the checkpoint is read."""
    prompt = str(cfg.prompt)
    if not prompt:
        bad_value("prompt", prompt, "text to continue (leave prompt out to start from a newline)")
    return {
        "prompt": prompt,
        "tokens": integer("tokens", cfg.tokens, minimum=1),
        "temperature": number("temperature", cfg.temperature, minimum=0,
                              allowed="a finite number >= 0 (0 = greedy: the most likely token each step)"),
        "top_k": integer("top_k", cfg.top_k, minimum=0, allowed="an integer >= 0 (0 = all tokens)"),
        "top_p": number("top_p", cfg.top_p, above=0, maximum=1),
        "cache": flag("cache", cfg.cache),
        "seed": integer("seed", cfg.seed, minimum=0),
        "device": device_arg(cfg.device),
    }


def main(argv: list[str]) -> int:
    cfg = command_line("sample", argv, __doc__)
    if cfg is None:
        return 0
    options = parse_options(cfg)
    ckpt = checked_checkpoint(required(cfg, "ckpt", "PATH"))
    import torch
    from omegaconf import OmegaConf

    from data.tokenizers import get_tokenizer
    from pelab.checkpoint import load_lit_gpt

    run_config = ckpt.parent / "config.yaml"
    tokenizer_name = OmegaConf.load(run_config).data.tokenizer if run_config.is_file() else "bytes"
    tokenizer = get_tokenizer(tokenizer_name)
    device = options["device"]
    torch.manual_seed(options["seed"])
    gpt = load_lit_gpt(ckpt, map_location=device).model.eval()

    ids = torch.tensor([tokenizer.encode(options["prompt"])], device=device)
    new_tokens = options["tokens"]
    limit = gpt.pe.max_positions
    if limit is not None and ids.shape[1] >= limit:
        bad_value("prompt", options["prompt"][:40] + ("..." if len(options["prompt"]) > 40 else ""),
                  f"fewer than the {limit} positions of pe={gpt.pe.name} (it is {ids.shape[1]} tokens)")
    if limit is not None and ids.shape[1] + new_tokens > limit:
        new_tokens = limit - ids.shape[1]
        print(f"[pelab] pe={gpt.pe.name} has {limit} positions: generating {new_tokens} tokens", file=sys.stderr)
    ids = gpt.generate(ids, new_tokens, temperature=options["temperature"], top_k=options["top_k"] or None,
                       top_p=options["top_p"], cache=options["cache"])
    print(tokenizer.decode(ids[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
