"""Row-sharded embedding bags beside allreduced dense parameters: the sharded bags and their plan (bags.py),
sparse row-wise optimizers (sparse_optim.py), and sharded save/load (store.py)."""
