"""The paper's draft model (Chen et al. 2023, section 4): a 4B-parameter Chinchilla-style
model "optimised for sampling latency" on the same 16 TPU v4 chips as its target.

Where each number comes from:
  Chen et al. 2023, section 4: 8 layers, d_model 6144,
      ffw 24576 (4 x d_model), head size 128, hence 6144 / 128 = 48 heads; the paper
      measured 1.8 ms/token for it on TPU v4 (a figure from the paper, not from here).
  Shared with the target (configs/chinchilla_70b.py) because the draft must use the same
      tokenizer and is trained like it: the 32,000-token SentencePiece vocabulary,
      RMSNorm, Transformer-XL relative positions, bf16, context 2048.
  Resulting size (ModelConfig.num_params): 4.32B = 8 x (5 d^2 + 8 d^2) + 2 x 32000 x d.
  Why wide and shallow: at batch 1 on 16 chips a step costs a fixed latency per layer
      (two all-reduces) plus the weight reads; 8 layers of d_model 6144 keep both small
      (`python -m specjax.plan --config=chinchilla_70b` prints the split).
  48 heads split over 8 or 16 'model' devices but not 32: a 1x32 mesh is rejected at
      start-up (64 heads of 96, the same parameter count, would split).
"""
from specjax.config import Config, MeshConfig, ModelConfig

MODEL = ModelConfig(vocab_size=32000, d_model=6144, num_layers=8, num_heads=48, num_kv_heads=48,
                    head_dim=128, d_ff=24576, max_seq_len=2048, ffw="gelu", pos_encoding="relative",
                    param_dtype="bfloat16", compute_dtype="bfloat16", scan_layers=True)


def get_config() -> Config:
    return Config(name="draft_4b", target=MODEL, mesh=MeshConfig(data=1, model=16))
