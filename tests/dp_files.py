"""Pieces of diffusion-pipe-style config files shared by the compatibility tests: our own TOML, in the key
structure of diffusion-pipe's examples/main_example.toml."""

DP_OPTIMIZER = """
[optimizer]
type = 'adamw_optimi'
lr = 2e-5
betas = [0.9, 0.99]
weight_decay = 0.01
eps = 1e-8
"""

DP_MONITORING = """
[monitoring]
enable_wandb = false
wandb_api_key = ''
wandb_tracker_name = ''
wandb_run_name = ''
"""

# examples/dataset.toml's bucket settings (num_ar_buckets and the rest vary between the examples)
DP_AR_BUCKETS = """
resolutions = [512]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
"""
