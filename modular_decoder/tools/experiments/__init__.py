"""Small runs that check the seed's findings (`modular-decoder experiment ...`): gradient norms of
post- vs pre-norm (`gradnorm`), the 8d/3 FFN budget (`ffn_budget`), matched-budget ablations (`ablation`)."""
