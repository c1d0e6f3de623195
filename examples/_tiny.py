"""Tiny random models built in a second, offline: what the examples' ``--tiny`` runs on.

A byte-level BPE tokenizer trained on the example's own texts (with an EOS, a pad and a chat
template), a 2-block Llama policy and a 1-block Llama reward model, all random. Their numbers
mean nothing; they let the examples (and ``tests/e2e/test_examples.py``) run the real code paths in
seconds, with nothing downloaded.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A minimal chat template: each message as ``<role>content``; the assistant's turn opened."""


def tiny_tokenizer(texts: list[str]):
    """A byte-level BPE tokenizer (vocabulary 300) fitted on ``texts``, EOS = pad = ``<eos>``,
    left padding, :data:`CHAT_TEMPLATE`."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=300, min_frequency=1, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")
    tok.padding_side = "left"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(tok, layers: int, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        **extra,
    )


def tiny_policy(tok, seed: int = 0):
    """A random 2-block Llama causal LM for ``tok`` (eval mode: no dropout)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_config(tok, 2, tie_word_embeddings=True)).eval()


def tiny_reward_model(tok, seed: int = 1):
    """A random 1-block Llama sequence classifier with one label (a reward model) for ``tok``."""
    import torch
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    return LlamaForSequenceClassification(_config(tok, 1, num_labels=1)).eval()


def small_run(tiny: bool, out: str | None) -> list[str]:
    """The overrides every example shares: a 4-prompt held-out evaluation with the run's own
    reward (no gold or fluency judge, no periodic evaluation), no checkpoint, no saved policy,
    the progress bar off with ``--tiny``, and ``train.output_dir`` when ``--out`` names one."""
    overrides = [
        "eval.n_prompts=4",
        "eval.samples_per_prompt=1",
        "eval.every=0",
        "eval.judge=none",
        "eval.fluency_model=none",
        "train.checkpoint_every=0",
        "train.save_model=false",
        f"train.progress={'false' if tiny else 'true'}",
    ]
    return overrides + ([f"train.output_dir={out}"] if out else [])
