"""Helpers of the test suite, not tests themselves: the multi-rank harness (``harness``), the
parity recipes and reference runs (``parity``), the models they train (``models``,
``zero3_models``), shared checkpoint rank functions (``checkpoint_helpers``), the
``torch.distributed`` byte counter (``ring_counter``), what the Lightning and Trainer ranks run
(``lightning_runs``, ``trainer_runs``), the two-node torchrun launcher (``launch``), and the
scripts the tests start as processes (``*_script.py``). tests/README.md maps shardpar's modules
and notes to the tests that check them."""
