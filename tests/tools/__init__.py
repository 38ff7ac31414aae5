"""Tests of service/tools."""
