"""The live job dashboard: pages and static assets served by the master (or by ``convoy dashboard`` for several
run dirs), behind a one-time login code that becomes an HttpOnly session cookie."""
