"""Checkpoints: conversion of research checkpoints to the speculators format, and their validation."""
