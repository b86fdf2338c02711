"""The embedded default for `python -m specjax.sample`: the trained mini pair.
Target weights come from mini_target's checkpoint, draft weights from mini_draft's."""
from specjax.config import Config, SamplingConfig, load_config


def get_config() -> Config:
    target = load_config("mini_target").target
    draft = load_config("mini_draft").target
    return Config(name="mini", target=target, draft=draft, tokenizer_vocab=target.vocab_size,
                  target_from="mini_target", draft_from="mini_draft",
                  # K=4: the fastest of K=2, 3, 4, 6 measured for the trained pair on CPU with
                  # the CPU kernels (BENCHMARKS.md section 8, "The trained pair ... the demo's K").
                  sampling=SamplingConfig(temperature=0.8, top_p=0.95, lookahead=4, max_new_tokens=128))
