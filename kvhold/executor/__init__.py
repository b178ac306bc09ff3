"""Disposable executor processes and the reference torch engine."""
