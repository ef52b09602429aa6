"""The qwen4_exp model family: model (the stack), qsa, ple, hyper, gdn."""
