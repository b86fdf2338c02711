"""The embedded default for `python -m specjax.sample`: the trained mini pair.
Target weights come from mini_target's checkpoint, draft weights from mini_draft's."""
from specjax.config import Config, SamplingConfig, load_config


def get_config() -> Config:
    target = load_config("mini_target").target
    draft = load_config("mini_draft").target
    return Config(name="mini", target=target, draft=draft, tokenizer_vocab=target.vocab_size,
                  target_from="mini_target", draft_from="mini_draft",
                  # the heads --drafter=medusa, --drafter=eagle and --drafter=eagle3 use
                  heads_from="mini_medusa,mini_eagle,mini_eagle3",
                  # K=6: the fastest SpS of K=2..7 for the trained pair on CPU with the packed
                  # few-row kernel, which scores up to 8 tokens for about the cost of one
                  # (benchmarks/kernels.md, "Second round ... the demo's K").
                  sampling=SamplingConfig(temperature=0.8, top_p=0.95, lookahead=6, max_new_tokens=128))
