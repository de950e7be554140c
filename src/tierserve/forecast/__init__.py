"""Forecasting the traffic of the next day or week from the ledger's history.

history.py turns a ledger into hourly series per tier; model.py fits seasonal models and
picks one by backtest against the seasonal-naive baseline; cli.py is `tierserve forecast`.
Its JSON is what `tierserve plan --forecast` reads (sim/hourly.py).
"""
