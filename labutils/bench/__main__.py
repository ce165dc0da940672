"""python -m labutils.bench"""
import sys

from labutils.bench import main

sys.exit(main())
