"""Evaluation and inference outside the training loop: long prompts prefilled layer by layer, dense or
FlexPrefill (`prefill`); `upcycle eval`'s needle, perplexity and prompt tasks (`long_eval`) and its
table and plot (`long_eval_report`); one decoder layer at a time for `upcycle verify` (`layerwise`);
loss and perplexity of a checkpoint (`evaluate`); each source's mean router input for
`dense-to-moe --router-init` (`calibration`).

May import: `upcycler.train.config`, `model`, `data` and the layers below the trainer; never the loop,
the techniques or reporting: evaluating a checkpoint needs no training state.
"""
