"""Shim so that older pip versions can do an editable install; metadata lives in setup.cfg."""
import setuptools

setuptools.setup()
