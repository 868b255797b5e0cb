"""Autoscaling per pool: ``policy`` (pure: a window of replica reports in, a replica count and its
reason out), ``simulator`` and ``traces`` (replaying request traces against a policy), and
``serve_adapter``, the only Ray import, which runs a policy as Ray Serve's custom autoscaling policy.
"""
