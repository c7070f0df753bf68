"""Token choice: greedy, temperature, top-k, top-p, ``min_tokens`` masking, and the token stop rules."""
