"""From logits to tokens: penalties, bad words, the top-k/top-p/min-p floors and the Gumbel-max draw."""
