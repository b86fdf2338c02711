"""Chinchilla 70B as the target and the paper's 4B draft, on 16 TPU v4 chips, K=4.

Where each number comes from:
  Hoffmann et al. 2022 (Chinchilla), Table 4: 80 layers, 64 heads, key/value size 128,
      d_model 8192. Section 4.1: the Gopher architecture and set-up, with a slightly
      modified SentencePiece tokenizer of 32,000 tokens; bf16 forward/backward.
  Rae et al. 2021 (Gopher), section 3 / Table 1: feed-forward size 4 x d_model = 32768,
      RMSNorm instead of LayerNorm, Transformer-XL relative position encodings (Dai et
      al. 2019) instead of absolute ones, context 2048 tokens (max_seq_len).
  Not stated in either paper: the ffw activation (GELU here, two matrices, so the ffw
      holds 2 x 4 x d_model^2 params as in Gopher's count), tied or untied embeddings
      (untied here). num_kv_heads = num_heads: multi-head attention (2022, before GQA).
  Resulting size (ModelConfig.num_params): 70.3B = 80 x (4 d^2 attention + 8 d^2 ffw
      + d^2 for W_r of the relative positions) + 2 x 32000 x d embeddings.
  Chen et al. 2023, section 4 and Table 1: the 70B target and a 4B draft
      (configs/draft_4b.py) served together on 16 TPU v4 chips ('model' axis 16: Megatron
      tensor parallelism, as the paper's serving set-up), batch 1, lookahead K=4.
      Sampling here is Table 1's HumanEval setting (temperature 0.8, top-p 0.95); XSum
      used nucleus p=0.8 and greedy. The paper's timings: 14.1 ms/token for the target
      alone, 1.8 ms/token for the draft; `python -m specjax.plan` sets the roofline of
      this config against them.
  scan_layers: one stacked, scanned layer keeps the compiled 80-layer program small.
"""
from specjax.config import Config, MeshConfig, ModelConfig, SamplingConfig

TARGET = ModelConfig(vocab_size=32000, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=64,
                     head_dim=128, d_ff=32768, max_seq_len=2048, ffw="gelu", pos_encoding="relative",
                     param_dtype="bfloat16", compute_dtype="bfloat16", scan_layers=True)


def get_config() -> Config:
    from specjax.config import load_config
    draft = load_config("draft_4b").target
    return Config(name="chinchilla_70b", target=TARGET, draft=draft, mesh=MeshConfig(data=1, model=16),
                  sampling=SamplingConfig(temperature=0.8, top_p=0.95, lookahead=4, max_new_tokens=128))
