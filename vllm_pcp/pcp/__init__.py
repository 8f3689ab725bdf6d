"""Prefill context parallelism: the split of a step's prefills over the PCP ranks
(:mod:`.partition`, pure), the K/V exchange (:mod:`.exchange`), the ragged kernel of
fresh prompts (:mod:`.ragged`) and the memory a split step holds (:mod:`.memory`)."""
