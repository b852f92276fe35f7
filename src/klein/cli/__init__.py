"""`klein`, the command line (`main`, and a module per command). The top of the order: may import everything
below it, `klein.serve` and `klein.batch` only to start them (from `serve` and `batch`); nothing imports it."""
