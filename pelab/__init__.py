"""pelab's harness, above the network (model/) and the data (data/): the LightningModule and its
optimiser, option validation, callbacks, checkpoints, run naming, loggers."""
