"""Metering: cost per request, prices, the ledger, budgets and the bill."""
