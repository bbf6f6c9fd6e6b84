"""python -m restartkit.cli"""
from restartkit.cli import main

main()
