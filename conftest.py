# Empty on purpose: its presence puts the repo root on sys.path, so tests can `import loss`.
